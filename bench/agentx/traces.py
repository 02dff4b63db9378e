"""Traces in the public AgentX form, and token ids synthesised from cache-block hashes.

AgentX (like the Mooncake traces it follows) publishes no text: each line is one request
with token counts and the hashes of its prompt's cache blocks. Accepted fields, one JSON
object per line (aliases in brackets):

    input_length   [input_tokens, prompt_tokens]       required, int >= 1
    output_length  [output_tokens, completion_tokens]  required, int >= 1
    hash_ids       [block_hashes]                      required, ints or strings, one per
                   block of the prompt (the last block may be partial)
    session_id     [conversation_id, chat_id]          optional; without it a line is a
                                                       session of one request
    turn           [round, turn_id]                    optional; else file order in the session
    timestamp      (ms, as Mooncake) [timestamp_ms], or timestamp_s (s)    optional
    think_time     (s) [think_time_s], or think_time_ms (ms)   optional, default 0: the time
                   the agent spent between the previous answer and this request
    block_size     tokens per hash block              optional; else the `trace_block_size`
                                                      option (default 512, Mooncake's)

Replay: every hash id becomes `replay_block_tokens` token ids drawn from a generator seeded
by (salt, hash id), so two requests with a common leading hash get identical leading token
blocks, and the prompt is the first `input_length` ids of its blocks. A run picks a fresh
salt per sweep level so one level cannot warm the cache for the next. With
`replay_block_tokens` smaller than the trace's block size, input and output lengths are scaled
by the same ratio (to fit long agent sessions into a small model's context). A request that
still does not fit `max_context_tokens` ends its session there (the agent could not continue).
"""
from __future__ import annotations

import math
import random
import sys
from functools import lru_cache

from .workload import Request, fill_shared_prefix


class TraceError(ValueError):
    """A trace line that cannot be replayed; the message names the file, line and field."""


_ALIASES = {
    "input": ("input_length", "input_tokens", "prompt_tokens"),
    "output": ("output_length", "output_tokens", "completion_tokens"),
    "hashes": ("hash_ids", "block_hashes"),
    "session": ("session_id", "conversation_id", "chat_id"),
    "turn": ("turn", "round", "turn_id"),
}


def _pick(obj: dict, names: tuple, where: str, required: bool):
    for n in names:
        if n in obj:
            return n, obj[n]
    if required:
        alt = f" (or {', '.join(names[1:])})" if len(names) > 1 else ""
        raise TraceError(f"{where}: missing field {names[0]!r}{alt}")
    return None, None


def _int(value, where: str, name: str, low: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) or value < low:
        raise TraceError(f"{where}: field {name!r} must be an integer >= {low}, got {value!r}")
    return int(value)


def _num(value, where: str, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise TraceError(f"{where}: field {name!r} must be a number >= 0, got {value!r}")
    return float(value)


def load_agentx(objs: list[tuple[int, dict]], path: str, *, trace_block_size: int = 512,
                replay_block_tokens: int | None = None, max_context_tokens: int | None = None) -> list[Request]:
    """Parsed AgentX lines ((line number, object) pairs) -> replayable requests."""
    rows = []
    for i, obj in objs:
        where = f"{path}:{i}"
        f_in, n_in = _pick(obj, _ALIASES["input"], where, True)
        f_out, n_out = _pick(obj, _ALIASES["output"], where, True)
        f_h, hashes = _pick(obj, _ALIASES["hashes"], where, True)
        n_in, n_out = _int(n_in, where, f_in, 1), _int(n_out, where, f_out, 1)
        if not isinstance(hashes, list) or not hashes or \
                not all(isinstance(h, (int, str)) and not isinstance(h, bool) for h in hashes):
            raise TraceError(f"{where}: field {f_h!r} must be a non-empty list of integers or strings")
        block = _int(obj.get("block_size", trace_block_size), where, "block_size", 1)
        if len(hashes) * block < n_in:
            raise TraceError(f"{where}: field {f_h!r} has {len(hashes)} blocks of {block} tokens, "
                             f"too few for {f_in}={n_in}")
        f_s, sid = _pick(obj, _ALIASES["session"], where, False)
        if sid is not None and not isinstance(sid, (str, int)):
            raise TraceError(f"{where}: field {f_s!r} must be a string or integer, got {sid!r}")
        f_t, turn = _pick(obj, _ALIASES["turn"], where, False)
        if turn is not None:
            turn = _int(turn, where, f_t)
        if "timestamp_s" in obj:
            ts = _num(obj["timestamp_s"], where, "timestamp_s")
        else:
            key = "timestamp" if "timestamp" in obj else "timestamp_ms"
            ts = _num(obj[key], where, key) / 1000 if key in obj else 0.0
        if "think_time_ms" in obj:
            think = _num(obj["think_time_ms"], where, "think_time_ms") / 1000
        else:
            key = "think_time" if "think_time" in obj else "think_time_s"
            think = _num(obj[key], where, key) if key in obj else 0.0
        rows.append(dict(line=i, sid=f"line-{i}" if sid is None else str(sid), turn=turn, n_in=n_in,
                         n_out=n_out, hashes=hashes, block=block, ts=ts, think=think))

    by: dict[str, list[dict]] = {}
    for r in rows:
        by.setdefault(r["sid"], []).append(r)
    requests, dropped = [], 0
    for sid, rs in by.items():
        if all(r["turn"] is not None for r in rs):
            rs.sort(key=lambda r: r["turn"])
        for k, r in enumerate(rs):
            replay = replay_block_tokens or r["block"]
            scale = replay / r["block"]
            n_in = max(1, math.floor(r["n_in"] * scale))
            n_out = max(1, math.floor(r["n_out"] * scale))
            if max_context_tokens is not None and n_in + n_out > max_context_tokens:
                dropped += len(rs) - k
                break
            requests.append(Request(
                session_id=sid, turn=k, api="completions", max_tokens=n_out, think_time_s=0.0 if k == 0 else r["think"],
                timestamp_s=r["ts"], input_tokens=n_in, nonce="", hash_ids=list(r["hashes"]),
                block_tokens=replay))
    if dropped:
        print(f"{path}: {dropped} request(s) left out: they do not fit {max_context_tokens} tokens of context "
              "(a session ends at its first such request)", file=sys.stderr)
    if not requests:
        raise TraceError(f"{path}: no request fits the context of {max_context_tokens} tokens")
    fill_shared_prefix(requests)
    return requests


@lru_cache(maxsize=65536)
def _block(salt: str, hash_id, n: int, low: int, high: int) -> tuple[int, ...]:
    rng = random.Random(f"{salt}|{type(hash_id).__name__}|{hash_id}")
    return tuple(rng.randrange(low, high) for _ in range(n))


def synthesise_prompt(req: Request, vocab_size: int, salt: str = "", low_id: int = 16) -> list[int]:
    """Token ids for a hash-id request; equal leading hashes give equal leading blocks.

    Ids below `low_id` are avoided: tokenizers put their special tokens first."""
    if vocab_size <= low_id:
        raise ValueError(f"vocab_size {vocab_size} leaves no ids at or above {low_id}")
    ids: list[int] = []
    for h in req.hash_ids:
        if len(ids) >= req.input_tokens:
            break
        ids.extend(_block(salt, h, req.block_tokens, low_id, vocab_size))
    return ids[:req.input_tokens]


# Our own trace form ------------------------------------------------------------------------

_OWN_FIELDS = {"session_id": str, "turn": int, "api": str, "max_tokens": int, "think_time_s": (int, float),
               "timestamp_s": (int, float), "input_tokens": int}


def request_from_json(obj: dict, where: str) -> Request:
    for name, typ in _OWN_FIELDS.items():
        if name not in obj:
            raise TraceError(f"{where}: missing field {name!r}")
        if isinstance(obj[name], bool) or not isinstance(obj[name], typ):
            raise TraceError(f"{where}: field {name!r} has the wrong type ({obj[name]!r})")
    if obj["api"] not in ("chat", "completions"):
        raise TraceError(f"{where}: field 'api' must be 'chat' or 'completions', got {obj['api']!r}")
    if obj["max_tokens"] < 1 or obj["think_time_s"] < 0:
        raise TraceError(f"{where}: fields 'max_tokens' must be >= 1 and 'think_time_s' >= 0")
    if obj["api"] == "chat":
        msgs = obj.get("messages")
        if not isinstance(msgs, list) or not msgs or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in msgs):
            raise TraceError(f"{where}: field 'messages' must be a non-empty list of {{role, content}} strings")
    else:
        hashes = obj.get("hash_ids")
        if not isinstance(hashes, list) or not hashes:
            raise TraceError(f"{where}: field 'hash_ids' must be a non-empty list for api 'completions'")
        block = obj.get("block_tokens")
        if isinstance(block, bool) or not isinstance(block, int) or block < 1:
            raise TraceError(f"{where}: field 'block_tokens' must be an integer >= 1, got {block!r}")
        if len(hashes) * block < obj["input_tokens"]:
            raise TraceError(f"{where}: field 'hash_ids' covers {len(hashes) * block} tokens, "
                             f"fewer than input_tokens={obj['input_tokens']}")
    known = {f.name for f in Request.__dataclass_fields__.values()}
    return Request(**{k: v for k, v in obj.items() if k in known and k != "shared_prefix_tokens"})


def to_agentx_json(req: Request) -> dict:
    """A hash-id request in the AgentX form `load_agentx` reads (timestamp in ms)."""
    if req.hash_ids is None:
        raise ValueError("only 'completions' (hash-id) requests have an AgentX form; generate with api='completions'")
    return {"session_id": req.session_id, "turn": req.turn, "timestamp": round(req.timestamp_s * 1000),
            "input_length": req.input_tokens, "output_length": req.max_tokens, "hash_ids": req.hash_ids,
            "think_time": req.think_time_s, "block_size": req.block_tokens}
