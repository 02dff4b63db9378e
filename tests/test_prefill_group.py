"""A prefill group of two ranks (DP attention + EP MoE, gloo) behind the P/D path."""
import pytest
import ray
from ray import serve

from app.main import build_app
from engine import EngineConfig, LLMEngine, SamplingParams

ENGINE = {"block_size": 4, "num_blocks": 256, "max_num_seqs": 8}


@pytest.fixture(scope="module")
def group(tiny_ckpt, tmp_path_factory):
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=str(tmp_path_factory.mktemp("ray")),
             logging_level="ERROR")
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": 0})
        args = {"model": {"path": str(tiny_ckpt)}, "engine": ENGINE, "prefill": {"replicas": 1, "group_size": 2},
                "decode": {"dp_size": 1}, "kv_transport": {"backend": "nixl", "local_prefill_max_tokens": 0},
                "eplb": {"enabled": False}}
        serve.run(build_app(args), name="wideep", route_prefix="/", blocking=False)
        yield serve.get_deployment_handle("DecodeGroup", app_name="wideep")
    finally:
        serve.shutdown()
        ray.shutdown()


def test_prefill_group_of_two_serves_pd_with_decode_alone_output(group, tiny_ckpt):
    prompts = [list(range(10 + i, 50 + i)) for i in range(4)]
    alone = LLMEngine.from_pretrained(tiny_ckpt, EngineConfig(**ENGINE), progress=False)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    expected = [o.output_token_ids for o in alone.generate(prompts, params)]
    stream = group.options(stream=True)
    got = []
    for i, p in enumerate(prompts):
        req = {"request_id": f"g{i}", "prompt_token_ids": p,
               "sampling": {"max_tokens": 8, "temperature": 0, "ignore_eos": True}}
        got.append([t for out in stream.generate.remote(req, None) for t in out["new_token_ids"]])
    assert got == expected
    assert group.stats.remote().result()[0]["prefill_remote"] == 4
    prefill = serve.get_deployment_handle("PrefillServer", app_name="wideep").stats.remote().result()
    assert prefill["served"] == 4 and prefill["held_kv"] == 0
    assert [r["served"] for r in prefill["ranks"]] == [2, 2]  # both ranks of the group took prompts
