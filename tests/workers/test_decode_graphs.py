"""Decode steps at fixed batch sizes over fixed buffers: the contract a CUDA graph's capture relies
on, held on CPU (where no graph is captured, `enforce_eager=False` runs the same padded batches
eagerly). The tokens and logprobs are the eager engine's at every batch size a run passes through;
each bucket's inputs are the same buffers every step; padding rows write no page and no state."""

from __future__ import annotations

import pytest
import torch

from cairn.kernels.conv import reference as conv_reference
from cairn.kernels.delta_rule import reference as delta_reference
from cairn.workers import Engine, SamplingParams
from cairn.workers.execution.decode_graphs import buckets


def prompts(lengths, vocab=211, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def test_buckets_are_powers_of_two_to_eight_then_steps_of_eight():
    assert buckets(1) == [1]
    assert buckets(5) == [1, 2, 4, 5]
    assert buckets(20) == [1, 2, 4, 8, 16, 20]
    assert buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_padded_static_decode_gives_the_eager_tokens_and_logprobs(hf_checkpoint, kind):
    path = hf_checkpoint(kind)
    ps = prompts([9, 3, 17, 5, 12, 7], seed=3)
    # different lengths: sequences finish one by one, so the batch passes through 6, 5, ... 1 rows
    params = [SamplingParams(max_tokens=4 + 3 * i, temperature=0, ignore_eos=True, logprobs=2) for i in range(6)]
    eager = Engine.from_pretrained(path, num_pages=64, max_num_seqs=8, enforce_eager=True)
    graphed = Engine.from_pretrained(path, num_pages=64, max_num_seqs=8, enforce_eager=False)
    assert eager.runner.graphs is None and graphed.runner.graphs is not None
    for want, got in zip(eager.generate(ps, params), graphed.generate(ps, params)):
        assert got.token_ids == want.token_ids
        torch.testing.assert_close(torch.tensor([lp.logprob for lp in got.logprobs]),
                                   torch.tensor([lp.logprob for lp in want.logprobs]), atol=1e-5, rtol=0)
    assert set(graphed.runner.graphs._static) >= {(1, 0), (2, 0), (4, 0), (8, 0)}  # it ran at those sizes
    graphed.check()


def test_each_bucket_reads_the_same_buffers_every_step(hf_checkpoint):
    engine = Engine.from_pretrained(hf_checkpoint("dense"), num_pages=64, max_num_seqs=4, enforce_eager=False)
    seen: list[tuple[int, dict[str, int]]] = []
    forward = engine.runner.model.forward

    def recording(batch, caches):
        if batch.num_decodes == batch.num_seqs:
            seen.append((batch.num_seqs, {name: getattr(batch, name).data_ptr() for name in
                                          ("input_ids", "positions", "seq_lens", "page_table", "slot_mapping",
                                           "state_slots", "logits_indices", "cu_seqlens")}))
        return forward(batch, caches)

    engine.runner.model.forward = recording
    engine.generate(prompts([5, 6, 7]), SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert len(seen) >= 5
    by_size: dict[int, dict[str, int]] = {}
    for size, pointers in seen:
        assert by_size.setdefault(size, pointers) == pointers, f"bucket {size} read new input buffers"
    assert set(by_size) == {4}  # 3 decoding sequences run at the bucket of 4
    assert len(engine.runner.graphs._static) == 1  # one buffer, made once


def test_a_padding_rows_slot_of_minus_one_reads_zeros_and_writes_no_state():
    g = torch.Generator().manual_seed(0)
    conv = torch.randn(4, 6, 3, generator=g)
    ssm = torch.randn(4, 2, 8, 8, generator=g)
    before = conv.clone(), ssm.clone()
    slots = torch.tensor([2, -1], dtype=torch.int64)
    x, w = torch.randn(2, 6, generator=g), torch.randn(6, 4, generator=g)
    out = conv_reference.causal_conv1d_update_slots(x, w, conv, slots)
    fresh = conv_reference.causal_conv1d_update_slots(x[1:], w, torch.zeros(1, 6, 3), torch.tensor([0]))
    torch.testing.assert_close(out[1:], fresh)  # from a zero state
    q, k = torch.randn(2, 1, 8, generator=g), torch.randn(2, 1, 8, generator=g)
    v, gate, beta = torch.randn(2, 2, 8, generator=g), -torch.rand(2, 2, generator=g), torch.rand(2, 2, generator=g)
    delta_reference.gated_delta_rule_step_slots(q, k, v, gate, beta, ssm, slots)
    for pool, old in zip((conv, ssm), before):
        assert torch.equal(pool[[0, 1, 3]], old[[0, 1, 3]])  # slot -1 is not the last slot
        assert not torch.equal(pool[2], old[2])
