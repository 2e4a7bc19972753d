"""Tensor parallelism on CPU (gloo): an engine spanning 2 or 4 ranks computes what the same
engine on one device computes, for every family (Qwen3-Next MoE, Qwen3.5 dense, Qwen3.5 MoE in
the vision-language layout, and the demo models), with more value heads than key heads and
fewer K/V heads than ranks; the same cache hits on a multi-turn trace however its prefill is
chunked, batched or preempted; a rank that dies fails the engine within the collective timeout
instead of hanging it; each rank reads only its part of every tensor."""

import os
import signal
import time

import pytest
import torch

import cairn.workers.model.loader as loader
from cairn.workers import EngineFront, Engine, SamplingParams
from cairn.workers.engine_errors import EngineBroken
from cairn.workers.model import read_model_config
from cairn.workers.model.family_registry import family_for
from cairn.workers.model.sharding import Shard, shard_config
from cairn.workers.execution.tp_runner import RankFailure
from tests.support.paths import REPO

KINDS = ["tp_next_moe", "tp_q35", "tp_q35_moe_vl"]
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=2)


def prompts(vocab: int, lengths=(1, 23, 57)) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def assert_same_outputs(ours, reference):
    for a, b in zip(ours, reference):
        assert a.token_ids == b.token_ids
        chosen = torch.tensor([lp.logprob for lp in a.logprobs])
        expected = torch.tensor([lp.logprob for lp in b.logprobs])
        torch.testing.assert_close(chosen, expected, atol=1e-4, rtol=0)
        assert [[t for t, _ in lp.top] for lp in a.logprobs] == [[t for t, _ in lp.top] for lp in b.logprobs]


@pytest.fixture(scope="module")
def reference():
    """TP 1's outputs per checkpoint, computed once."""
    return {}


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("kind", KINDS)
def test_greedy_tokens_and_logprobs_match_one_device(hf_checkpoint, reference, kind, tp):
    path = hf_checkpoint(kind)
    options = dict(num_pages=64, max_num_seqs=4)
    if kind not in reference:
        one = Engine.from_pretrained(path, **options)
        reference[kind] = one.generate(prompts(one.config.vocab_size), GREEDY), one.prompt_logits(prompts(211)[2])
    engine = Engine.from_pretrained(path, tensor_parallel_size=tp, **options)
    try:
        assert engine.config.num_attention_heads == 8 // tp  # rank 0 holds its share of the heads
        outs, logits = reference[kind]
        assert_same_outputs(engine.generate(prompts(engine.spec.vocab_size), GREEDY), outs)
        torch.testing.assert_close(engine.prompt_logits(prompts(211)[2]), logits, atol=1e-4, rtol=1e-4)
    finally:
        engine.close()


def test_prompts_with_images_at_tp_2_match_one_device(hf_checkpoint):
    """Two prompts with images (two in one, cut by a chunk), and a second turn resuming past its
    image: at TP 2, the tokens and logprobs of TP 1 (every rank encodes the images itself)."""
    from cairn.workers.request import GenerateRequest
    from tests.support.stepping import finish
    from tests.workers.vision.test_engine_images import CASES, with_images

    path = hf_checkpoint("tp_q35_vision")
    options = dict(num_pages=64, max_num_seqs=4, max_num_batched_tokens=24)
    runs = []
    for tp in (1, 2):
        engine = Engine.from_pretrained(path, tensor_parallel_size=tp, **options)
        try:
            outs = []
            for name in ("two_images", "a_larger_image_over_pages"):
                prompt, images = with_images(CASES[name])
                engine.add(GenerateRequest(name, prompt, GREEDY, images=images))
                outs.append(finish(engine, [name])[name])
                engine.add(GenerateRequest(name + "-2", prompt + outs[-1].token_ids + [5, 6, 7], GREEDY, images=images))
                outs.append(finish(engine, [name + "-2"])[name + "-2"])
                assert outs[-1].cached_tokens > images[-1].first_token
            runs.append(outs)
        finally:
            engine.close()
    assert_same_outputs(runs[1], runs[0])


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5", "qwen3_5_moe"])
def test_demo_models_at_tp_2_match_one_device(demo_model, arch):
    path = demo_model(arch)
    one = Engine.from_pretrained(path, num_pages=64, max_num_seqs=4)
    engine = Engine.from_pretrained(path, num_pages=64, max_num_seqs=4, tensor_parallel_size=2)
    try:
        ps = prompts(one.spec.vocab_size, (5, 40))
        assert_same_outputs(engine.generate(ps, GREEDY), one.generate(ps, GREEDY))
    finally:
        engine.close()


def converse(engine: Engine, turns: int = 4) -> list[tuple[list[int], int]]:
    """Three conversations, each turn its previous prompt and answer plus new tokens, run
    together: (output tokens, cached_tokens) per request."""
    g = torch.Generator().manual_seed(3)
    histories = [torch.randint(0, 200, (30 + 17 * c,), generator=g).tolist() for c in range(3)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    seen = []
    for _ in range(turns):
        outs = engine.generate(histories, params)
        seen += [(o.token_ids, o.cached_tokens) for o in outs]
        histories = [h + o.token_ids + torch.randint(0, 200, (9,), generator=g).tolist()
                     for h, o in zip(histories, outs)]
    return seen


def test_multi_turn_cache_hits_equal_one_devices_under_chunking_batching_and_preemption(hf_checkpoint):
    path = hf_checkpoint("tp_q35_moe_vl")
    # odd prefill chunks, and so few pages that the three conversations preempt each other
    tight = dict(page_size=8, num_pages=32, max_num_seqs=3, max_num_batched_tokens=13)
    one = Engine.from_pretrained(path, **tight)
    expected = converse(one)
    assert one.stats.preemptions > 0 and any(cached for _, cached in expected[3:])
    engine = Engine.from_pretrained(path, tensor_parallel_size=2, **tight)
    try:
        assert converse(engine) == expected
        assert engine.stats.preemptions == one.stats.preemptions
    finally:
        engine.close()


def test_a_world_size_the_shapes_do_not_divide_is_refused_naming_the_field(hf_checkpoint):
    with pytest.raises(ValueError, match=r"tensor_parallel_size 3 does not divide num_attention_heads \(8\)"):
        Engine.from_pretrained(hf_checkpoint("tp_q35"), tensor_parallel_size=3)
    with pytest.raises(ValueError, match=r"tensor_parallel_size 8 does not divide linear_num_key_heads \(4\)"):
        shard_config(read_model_config(hf_checkpoint("tp_q35") / "config.json"), 8)


def test_a_rank_that_dies_fails_the_engine_within_the_timeout_and_nothing_hangs(hf_checkpoint):
    engine = Engine.from_pretrained(hf_checkpoint("tp_q35"), num_pages=64, max_num_seqs=4, tensor_parallel_size=2,
                                    collective_timeout_s=5)
    try:
        assert engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2))[0].finish_reason == "length"
        os.kill(engine.runner.workers.processes[0].pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(RankFailure, match="rank 1"):
            engine.generate([[4, 5, 6]], SamplingParams(max_tokens=2))
        assert time.monotonic() - start < 30
        with pytest.raises(EngineBroken, match="rank 1: exited"):  # broken for good: replace the replica
            engine.generate([[4, 5, 6]], SamplingParams(max_tokens=2))
        with pytest.raises(EngineBroken):
            EngineFront(engine).check_health()  # what the replica's Serve health check calls
    finally:
        engine.close()


def test_a_rank_that_hangs_fails_the_step_after_the_collective_timeout(hf_checkpoint):
    engine = Engine.from_pretrained(hf_checkpoint("tp_q35"), num_pages=64, max_num_seqs=4, tensor_parallel_size=2,
                                    collective_timeout_s=3)
    pid = engine.runner.workers.processes[0].pid
    try:
        engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
        os.kill(pid, signal.SIGSTOP)  # alive, but never answers
        start = time.monotonic()
        with pytest.raises(RankFailure):
            engine.generate([[4, 5, 6]], SamplingParams(max_tokens=2))
        assert 2.5 <= time.monotonic() - start < 30, "failed by the timeout, not before it and not never"
    finally:
        os.kill(pid, signal.SIGCONT)
        engine.close()


def test_each_rank_reads_only_its_part_of_a_sharded_tensor(hf_checkpoint, loader_reads):
    path = hf_checkpoint("tp_q35_moe_vl")
    cfg = read_model_config(path / "config.json")
    family = family_for({"model_type": "qwen3_5_moe"})
    files = loader.weight_files(path)
    full = loader.read_tensors(files, torch.float32, family)
    loader_reads["whole"].clear()
    part = loader.read_tensors(files, torch.float32, family, cfg, Shard(1, 2))
    assert "model.language_model.layers.0.linear_attn.in_proj_qkv.weight" in loader_reads["sliced"]
    assert not [n for n in loader_reads["whole"] if "proj" in n or "embed" in n], "projections and embeddings: slices"
    name = "model.layers.0.linear_attn.in_proj_qkv.weight"
    assert part[name].shape[0] * 2 == full[name].shape[0]
    assert torch.equal(part["model.layers.0.input_layernorm.weight"], full["model.layers.0.input_layernorm.weight"])


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="the NCCL path needs at least 2 CUDA devices")
@pytest.mark.parametrize("kind", ["tp_next_moe", "tp_q35_moe_vl"])
def test_nccl_tp_2_on_two_gpus_matches_one_gpu(hf_checkpoint, kind):
    path = hf_checkpoint(kind)
    options = dict(num_pages=64, max_num_seqs=4, device="cuda", dtype="float32")
    one = Engine.from_pretrained(path, **options)
    expected = one.generate(prompts(one.spec.vocab_size), GREEDY)
    engine = Engine.from_pretrained(path, tensor_parallel_size=2, **options)
    try:
        assert engine.model.group is not None and next(engine.model.parameters()).device.type == "cuda"
        assert_same_outputs(engine.generate(prompts(engine.spec.vocab_size), GREEDY), expected)
    finally:
        engine.close()


def test_memory_utilization_sizes_each_ranks_arena_from_the_least_free_device(monkeypatch):
    """The arena a device can pay after its weights: utilization of its total, minus what is in
    use; tensor-parallel ranks agree on the smallest (one all-reduce), so their layouts match.
    CUDA's free-memory query is faked per rank; the ranks are threads over a real gloo group."""
    import threading

    from cairn.workers.cache.device_budget import arena_bytes, sized
    from cairn.workers.engine_options import EngineOptions
    from cairn.workers.execution.tp_group import TPGroup
    from cairn.workers.execution.tp_runner import free_address

    gib = 2**30
    assert arena_bytes(free=100 * gib, total=141 * gib, utilization=0.9) == int(100 * gib - 0.1 * 141 * gib)
    assert arena_bytes(free=5 * gib, total=141 * gib, utilization=0.9) == 0
    free = {"rank-0": 60 * gib, "rank-1": 52 * gib}  # rank 1's device has less left
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free[threading.current_thread().name],
                                                                           80 * gib))
    options, address, got = EngineOptions(memory_utilization=0.9), free_address(), {}

    def rank(r: int) -> None:
        group = TPGroup.connect(r, 2, address, "gloo", timeout_s=30)
        got[r] = sized(options, torch.device("cuda"), group).cache_memory_bytes

    threads = [threading.Thread(target=rank, args=(r,), name=f"rank-{r}") for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert got == {0: arena_bytes(52 * gib, 80 * gib, 0.9), 1: arena_bytes(52 * gib, 80 * gib, 0.9)}
    with pytest.raises(ValueError, match="memory_utilization sizes the arena from a CUDA device"):
        sized(options, torch.device("cpu"))
    with pytest.raises(ValueError, match="not both"):
        EngineOptions(memory_utilization=0.9, cache_memory_bytes=1 << 30)
    with pytest.raises(ValueError, match=r"memory_utilization must be a fraction in \(0, 1\]"):
        EngineOptions(memory_utilization=1.5)


def test_with_a_host_tier_every_rank_demotes_and_promotes_its_own_slice_in_step(hf_checkpoint):
    from cairn.workers import EngineOptions, EngineSpec

    path = hf_checkpoint("tp_q35_moe_vl")
    base = dict(page_size=8, max_num_seqs=3, max_num_batched_tokens=13)

    def sized(tp: int) -> dict:  # the same block counts at TP 1 and 2: each rank's blocks are its slice
        block = EngineSpec.from_model_dir(path, EngineOptions(tensor_parallel_size=tp, **base)).page_bytes
        return dict(base, cache_memory_bytes=40 * block, host_cache_bytes=400 * block)
    one = Engine.from_pretrained(path, **sized(1))
    expected = converse(one)
    m = one.metrics()
    assert m.pages_demoted_total > 0 and m.pages_promoted_total > 0 and any(c for _, c in expected[3:])
    engine = Engine.from_pretrained(path, tensor_parallel_size=2, **sized(2))
    try:
        assert engine.layout.num_blocks == one.layout.num_blocks and engine.layout.host_blocks == 400
        assert converse(engine) == expected
        assert engine.metrics().pages_promoted_total == m.pages_promoted_total
    finally:
        engine.close()


def test_a_script_without_a_main_guard_fails_at_once_saying_what_to_add(tiny_model_dir, tmp_path):
    """Each rank is a spawned process that imports the script again; without the guard it never
    starts, and the engine says so in seconds instead of waiting 60 s for the group to form."""
    import subprocess
    import sys

    script = tmp_path / "unguarded.py"
    script.write_text(f"from cairn.workers import Engine\nEngine.from_pretrained({str(tiny_model_dir)!r}, "
                      f"tensor_parallel_size=2)\nprint('built')\n")
    root = REPO
    started = time.monotonic()
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(root)})
    assert done.returncode != 0 and "built" not in done.stdout
    assert "RankFailure" in done.stderr and 'if __name__ == "__main__":' in done.stderr, done.stderr[-2000:]
    assert time.monotonic() - started < 45, "no wait for the group's rendezvous timeout"
