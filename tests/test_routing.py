"""Decode-rank routing policies (deployments/rank_router.py) and their config (routing.policy)."""
from collections import Counter

import pytest

from app.config import ConfigError, parse_app_config
from deployments.rank_router import RankRouter, prefix_key

SYSTEM = "You are a coding agent. " * 200  # ~4,800 characters, like the AgentX system prompt


def _chat(session: int, turn: int) -> dict:
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"task {session}: fix the bug"}]
    for t in range(turn):
        msgs += [{"role": "assistant", "content": f"step {t}"}, {"role": "user", "content": f"tool output {t}"}]
    return {"messages": msgs}


def _closed_loop(router: RankRouter, sessions: int = 8, turns: int = 4, ranks: int = 2) -> dict[int, list[int]]:
    """Every session sends its turns one after another, all sessions live at once (what the
    AgentX client does at concurrency = sessions): the rank of each turn, per session."""
    running, placed = [0] * ranks, {s: [] for s in range(sessions)}
    for turn in range(turns):
        done = []
        for s in range(sessions):
            r = router.pick(running, f"agent-{s}", _chat(s, turn))
            running[r] += 1
            placed[s].append(r)
            done.append(r)
        for r in done:  # the turn ends before the next one starts
            running[r] -= 1
    return placed


def test_prefix_key_covers_the_first_user_turn_not_only_a_long_system_prompt():
    """Agents sharing a long system prompt used to get one key (the first 2,048 characters of
    the prompt): every request then went to one rank, while the other sat idle."""
    keys = {prefix_key(_chat(s, 0)) for s in range(8)}
    assert len(keys) == 8
    assert prefix_key(_chat(3, 0)) == prefix_key(_chat(3, 5))  # later turns keep the conversation's key
    assert prefix_key({"prompt": "x" * 5000}) == prefix_key({"prompt": "x" * 4000})
    assert prefix_key({"prompt_token_ids": [1, 2, 3]}) != prefix_key({"prompt_token_ids": [1, 2, 4]})
    assert prefix_key({}) is None


@pytest.mark.parametrize("policy", ["session_affinity", "prefix"])
def test_sticky_policies_keep_each_session_on_one_rank_and_use_both(policy):
    placed = _closed_loop(RankRouter(policy))
    assert all(len(set(ranks)) == 1 for ranks in placed.values())
    assert Counter(ranks[0] for ranks in placed.values()) == {0: 4, 1: 4}


def test_sticky_session_moves_when_its_rank_is_saturated():
    router = RankRouter("session_affinity", saturated_at=2)
    assert router.pick([0, 0], "a") == 0
    assert router.pick([1, 0], "a") == 0
    assert router.pick([2, 0], "a") == 1  # saturated: the least loaded takes the session over
    assert router.pick([0, 0], "a") == 1


def test_session_affinity_without_a_session_follows_prefix_aware():
    aware, blind = RankRouter("session_affinity"), RankRouter("session_affinity", prefix_aware=False)
    assert aware.pick([0, 0], None, _chat(1, 0)) == 0
    assert aware.pick([0, 5], None, _chat(1, 2)) == 0 and len(aware) == 1
    assert blind.pick([0, 0], None, _chat(1, 0)) == 0
    assert blind.pick([3, 0], None, _chat(1, 2)) == 1 and len(blind) == 0


def test_prefix_policy_ignores_session_ids():
    router = RankRouter("prefix")
    assert router.pick([0, 0], "a", _chat(1, 0)) == 0
    assert router.pick([4, 0], "b", _chat(1, 1)) == 0  # another session id, same conversation head


@pytest.mark.parametrize("policy", ["least_loaded", "power_of_two", "random"])
def test_load_policies_bind_nothing(policy):
    router = RankRouter(policy, seed=0)
    placed = _closed_loop(router, sessions=8, turns=6)
    assert len(router) == 0
    moved = sum(len(set(r)) > 1 for r in placed.values())
    if policy == "random":
        assert moved > 0  # turns of a session scatter
    else:
        # at every turn the 8 live requests split 4 / 4: the load decides, not the session
        per_turn = [Counter(r[t] for r in placed.values()) for t in range(6)]
        assert all(c == {0: 4, 1: 4} for c in per_turn)


def test_least_loaded_and_power_of_two_follow_the_counts():
    assert RankRouter("least_loaded").pick([3, 1, 2], "s") == 1
    assert RankRouter("least_loaded").pick([1, 1], "s") == 0
    p2 = RankRouter("power_of_two", seed=1)
    picks = Counter(p2.pick([5, 0, 5, 5]) for _ in range(400))
    assert picks[1] > 150 and set(picks) <= {0, 1, 2, 3}  # rank 1 wins whenever it is drawn (half the time)
    assert RankRouter("power_of_two").pick([2, 1]) == 1
    rnd = RankRouter("random", seed=0)
    assert set(Counter(rnd.pick([0, 0, 0]) for _ in range(60))) == {0, 1, 2}


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="round_robin"):
        RankRouter("round_robin")


# config -------------------------------------------------------------------------------------

def test_policy_config_defaults_and_the_older_switch():
    assert parse_app_config({}).routing.policy == "session_affinity"
    cfg = parse_app_config({"routing": {"policy": "least_loaded"}}).routing
    assert (cfg.policy, cfg.session_affinity) == ("least_loaded", False)
    # the older switch keeps its meaning: off binds requests by their prompt head, not by session
    cfg = parse_app_config({"routing": {"session_affinity": False}}).routing
    assert (cfg.policy, cfg.session_affinity) == ("prefix", False)
    assert parse_app_config({"routing": {"session_affinity": True}}).routing.policy == "session_affinity"
    assert parse_app_config({"routing": {"session_affinity": False, "policy": "random"}}).routing.policy == "random"


@pytest.mark.parametrize("routing, needle", [
    ({"policy": "round_robin"}, "args.routing.policy"),
    ({"policy": "least_loaded", "session_affinity": True}, "contradicts policy 'least_loaded'"),
    ({"policy": "session_affinity", "session_affinity": False}, "contradicts policy 'session_affinity'"),
])
def test_bad_policy_config_fails_naming_the_field(routing, needle):
    with pytest.raises(ConfigError, match=needle):
        parse_app_config({"routing": routing})
