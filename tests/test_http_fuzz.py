"""Fuzzing the HTTP API from its own OpenAPI document plus hand-written hostile inputs, on a
real tiny engine behind uvicorn (the harness is bench/fuzz_http.py; this runs it small)."""
import copy
from types import SimpleNamespace

import httpx2 as httpx
import pytest
import schemathesis

from app.openapi import openapi_spec
from bench import fuzz_http as fz

SCHEMA_CASES = 200  # plus the hand-written ones; about 25 s on a 2-core machine


@pytest.fixture(scope="module")
def served(tiny_ckpt):
    with fz.serve(str(tiny_ckpt)) as served:
        yield served


def test_spec_is_a_valid_openapi_document():
    for kwargs in ({}, dict(max_model_len=256, max_tokens_limit=64, max_body_bytes=10, vocab_size=512, auth=True)):
        schema = schemathesis.openapi.from_dict(openapi_spec("m", **kwargs))
        schema.validate()  # against the OpenAPI 3.1 meta-schema
        ops = {(op.method.upper(), op.path) for op in (r.ok() for r in schema.get_all_operations())}
        assert ops == {("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("POST", "/tokenize"),
                       ("POST", "/detokenize"), ("GET", "/v1/models"), ("GET", "/health")}


def test_spec_follows_the_configuration():
    spec = openapi_spec("m", max_model_len=256, max_tokens_limit=64, vocab_size=512, auth=True)
    schemas = spec["components"]["schemas"]
    max_tokens = schemas["ChatCompletionRequest"]["properties"]["max_tokens"]["anyOf"][0]
    assert (max_tokens["minimum"], max_tokens["maximum"]) == (1, 64)
    token = schemas["CompletionRequest"]["properties"]["prompt"]["anyOf"][1]["items"]
    assert (token["minimum"], token["maximum"]) == (0, 511)
    assert "401" in spec["paths"]["/v1/completions"]["post"]["responses"]
    open_spec = openapi_spec("m", max_model_len=256)
    assert open_spec["components"]["schemas"]["CompletionRequest"]["properties"]["max_tokens"]["anyOf"][0][
        "maximum"] == 255
    assert "401" not in open_spec["paths"]["/v1/completions"]["post"]["responses"]


def test_openapi_route_serves_the_spec_without_a_key(served):
    resp = httpx.get(served.url + "/openapi.json", timeout=30)
    assert resp.status_code == 200
    assert resp.json() == openapi_spec(fz.MODEL, max_model_len=served.max_model_len,
                                       max_tokens_limit=served.max_tokens_limit,
                                       max_body_bytes=served.max_body_bytes, auth=True)


def test_schema_and_hand_written_fuzzing_leaves_no_5xx_and_a_healthy_idle_server(served):
    tally = fz.Tally()
    plan = fz.run_schema_cases(served, tally, cases=SCHEMA_CASES)
    hand = fz.hand_cases(served.vocab_size, served.max_body_bytes, served.max_model_len)
    fz.run_hand_cases(served, tally, hand)
    after = fz.aftermath_problems(served)

    assert tally.failures == []
    assert after == []
    # every planned case ran: hypothesis stopping early would pass the checks above vacuously
    assert sum(plan.values()) == SCHEMA_CASES
    for (method, path, mode), n in plan.items():
        assert tally.tried[f"schema:{method} {path} {mode}"] == n, (method, path, mode)
    assert tally.tried["hand"] == len(hand) > 100
    assert sum(tally.statuses.values()) == tally.total
    assert not [s for s in tally.statuses if s >= 500]
    # both kinds of outcome are exercised: valid requests reach the engine, invalid ones are refused
    assert tally.statuses[200] >= 40 and tally.statuses[400] >= 40 and tally.statuses[413] >= 2


def test_harness_reports_a_response_that_breaks_the_spec(served):
    # the checks must be able to fail: a spec demanding a field that /health never sends
    spec = copy.deepcopy(served.spec)
    spec["components"]["schemas"]["Health"]["required"].append("system_fingerprint")
    tally = fz.Tally()
    fz.run_schema_cases(SimpleNamespace(**{**vars(served), "spec": spec}), tally, cases=6)
    assert [f for f in tally.failures if "system_fingerprint" in f and f.startswith("schema:GET /health")]
