"""DeepSeek-V3 mode against transformers' DeepseekV3ForCausalLM loaded from the same checkpoint."""
import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling import SamplingParams

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_model(tiny_ckpt):
    return transformers.DeepseekV3ForCausalLM.from_pretrained(str(tiny_ckpt), dtype=torch.float32).eval()


def _recording_engine(ckpt, **cfg):
    engine = LLMEngine.from_pretrained(ckpt, EngineConfig(**cfg), progress=False)
    recorded = []
    sample = engine.runner.sample

    def record(seqs, logits):
        recorded.append({s.request_id: logits[i].clone() for i, s in enumerate(seqs)})
        return sample(seqs, logits)
    engine.runner.sample = record
    return engine, recorded


def _hf_greedy(hf_model, prompt, n):
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                                output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), [l[0] for l in out.logits]


@pytest.mark.parametrize("chunk", [512, 7])
def test_prefill_and_every_decode_step_match_transformers(tiny_ckpt, hf_model, chunk):
    engine, recorded = _recording_engine(tiny_ckpt, max_num_batched_tokens=chunk, block_size=4)
    prompt = engine.tokenizer.encode("Hello, who are you? The quick brown fox jumps over the lazy dog.")
    hf_tokens, hf_logits = _hf_greedy(hf_model, prompt, 32)
    out = engine.generate([prompt], SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))[0]
    ours = [next(iter(step.values())) for step in recorded]
    assert len(ours) == 32
    for step, (a, b) in enumerate(zip(ours, hf_logits)):
        torch.testing.assert_close(a, b.float(), atol=2e-5, rtol=1e-4, msg=f"decode step {step}")
    assert out.output_token_ids == hf_tokens


def test_batch_of_different_prompts_matches_transformers_one_by_one(tiny_ckpt, hf_model):
    engine, _ = _recording_engine(tiny_ckpt, max_num_batched_tokens=24, block_size=4)
    texts = ["def main(): print", "The key value cache", "Numbers 0 1 2 3 4 5 6 7 8 9 10 100", "hi"]
    prompts = [engine.tokenizer.encode(t) for t in texts]
    outs = engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.output_token_ids == _hf_greedy(hf_model, prompt, 12)[0]
