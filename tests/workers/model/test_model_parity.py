"""cairn's engine computes what transformers computes, family by family, on checkpoints
transformers itself wrote: prompt logits, greedy tokens and their logprobs.

Families and layouts: Qwen3-Next (dense, MoE with a shared expert, tied embeddings) and Qwen3.5 /
3.6 dense and MoE, both in the text-only `*ForCausalLM` layout and the published
vision-language `*ForConditionalGeneration` one (tied and untied)."""

import pytest
import torch
from tests.support.checkpoints import hf_reference_model as hf_model

from cairn.workers import Engine, SamplingParams

LENGTHS = [1, 7, 53]  # one token, odd, several pages of 16
KINDS = ["dense", "moe", "tied", "q35_dense", "q35_dense_vl", "q35_tied", "q35_tied_vl", "q35_moe", "q35_moe_vl"]


def prompt(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", LENGTHS)
def test_prompt_logits_match_transformers(hf_checkpoint, kind, n):
    path = hf_checkpoint(kind)
    engine = Engine.from_pretrained(path, num_pages=32, max_num_seqs=2)
    ids = prompt(n, engine.config.vocab_size, seed=n)
    with torch.no_grad():
        expected = hf_model(path)(torch.tensor([ids])).logits[0].float()
    got = engine.prompt_logits(ids)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", LENGTHS)
def test_greedy_tokens_and_logprobs_match_transformers(hf_checkpoint, kind, n):
    path = hf_checkpoint(kind)
    engine = Engine.from_pretrained(path, num_pages=32, max_num_seqs=2)
    ids = prompt(n, engine.config.vocab_size, seed=100 + n)
    out = engine.generate([ids], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=3))[0]

    model = hf_model(path)
    with torch.no_grad():
        ref = model.generate(torch.tensor([ids]), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                             eos_token_id=None, pad_token_id=0)[0, n:].tolist()
        full = torch.tensor([ids + ref])
        ref_logprobs = torch.log_softmax(model(full).logits[0, n - 1:-1].float(), dim=-1)
    assert out.token_ids == ref
    assert out.finish_reason == "length"
    chosen = torch.tensor([lp.logprob for lp in out.logprobs])
    torch.testing.assert_close(chosen, ref_logprobs[torch.arange(16), torch.tensor(ref)], atol=2e-4, rtol=0)
    for i, lp in enumerate(out.logprobs):
        top_vals, top_ids = torch.topk(ref_logprobs[i], 3)
        assert [t for t, _ in lp.top] == top_ids.tolist()


def test_bf16_checkpoint_runs_in_bf16_and_tracks_fp32(tmp_path):
    """(dtype given: auto is pinned to fp32 under the tests, see conftest)"""
    from tests.support.checkpoints import build_hf_checkpoint

    path = build_hf_checkpoint(tmp_path / "bf16", "dense", dtype=torch.bfloat16)
    engine = Engine.from_pretrained(path, num_pages=16, max_num_seqs=1, dtype="bfloat16")
    assert next(engine.model.parameters()).dtype == torch.bfloat16
    ids = prompt(20, engine.config.vocab_size, seed=3)
    got = engine.prompt_logits(ids)
    fp32 = Engine.from_pretrained(path, num_pages=16, max_num_seqs=1, dtype="float32").prompt_logits(ids)
    assert torch.isfinite(got).all()
    # bf16 activations: agreement on the argmax for the clear majority of positions
    assert (got.argmax(-1) == fp32.argmax(-1)).float().mean() >= 0.8


def test_sharded_checkpoint_loads_the_same_model(tmp_path, hf_checkpoint):
    from tests.support.checkpoints import build_hf_checkpoint

    sharded = build_hf_checkpoint(tmp_path / "sharded", "moe", max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").exists()
    ids = prompt(9, 211, seed=9)
    a = Engine.from_pretrained(sharded, num_pages=8, max_num_seqs=1).prompt_logits(ids)
    b = Engine.from_pretrained(hf_checkpoint("moe"), num_pages=8, max_num_seqs=1).prompt_logits(ids)
    torch.testing.assert_close(a, b)
