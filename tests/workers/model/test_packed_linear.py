"""CPU linears packed for oneDNN compute what `F.linear` computes, and only the linears whose
weights nothing else reads are packed: a tied LM head and the MoE's shared expert stay plain."""

import pytest
import torch
import torch.nn.functional as F
from tests.support.checkpoints import build_hf_checkpoint, hf_reference_model
from torch import nn

from cairn.workers import Engine, SamplingParams
from cairn.workers.model.packed_linear import PackedLinear, can_pack, pack_linears

pytestmark = pytest.mark.skipif(not can_pack(torch.device("cpu"), torch.float32), reason="torch built without oneDNN")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 96), (7, 96), (65, 96), (0, 96), (2, 5, 96)])
@pytest.mark.parametrize("bias", [False, True])
def test_a_packed_linear_computes_what_f_linear_computes(dtype, shape, bias):
    if not can_pack(torch.device("cpu"), dtype):
        pytest.skip(f"oneDNN computes no {dtype} on this CPU")
    torch.manual_seed(0)
    plain = nn.Linear(96, 40, bias=bias).to(dtype)
    x = torch.randn(*shape, dtype=dtype)
    want = F.linear(x, plain.weight, plain.bias)
    got = PackedLinear(plain)(x)
    assert got.shape == want.shape and got.dtype == dtype
    if dtype == torch.bfloat16:  # the same oneDNN kernel, only the weight's layout differs
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.body = nn.Linear(16, 16)
        self.head = nn.Linear(16, 50, bias=False)
        self.head.weight = self.embed.weight


def test_a_tied_weight_is_left_plain_and_the_rest_is_packed():
    model = Tied()
    assert pack_linears(model) == 1
    assert isinstance(model.body, PackedLinear) and isinstance(model.head, nn.Linear)
    assert model.head.weight is model.embed.weight


def test_off_the_cpu_or_in_half_precision_nothing_is_packed():
    model = nn.Sequential(nn.Linear(8, 8)).half()
    assert pack_linears(model) == 0 and isinstance(model[0], nn.Linear)


def test_the_moe_shared_expert_stays_plain_and_the_engine_answers_as_unpacked(tmp_path):
    """A Qwen3.5 MoE engine packs its projections but not the shared expert the fused MoE op
    reads as tensors, and its greedy tokens are transformers' own."""
    path = build_hf_checkpoint(tmp_path / "moe", "q35_moe")
    engine = Engine.from_pretrained(path, dtype="float32")
    layers = engine.model.model.layers
    moe = next(layer.mlp for layer in layers if hasattr(layer.mlp, "shared_expert"))
    assert engine.runner.packed_linears > 0 and isinstance(moe.gate, PackedLinear)
    assert all(isinstance(m, nn.Linear) for m in (*moe.shared_expert.children(), moe.shared_expert_gate))

    prompt = [5, 17, 3, 99, 42, 7, 7, 120, 1, 64, 33]
    got = engine.generate([prompt], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0].token_ids
    with torch.inference_mode():
        want = hf_reference_model(path).generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)
    assert got == want[0, len(prompt):].tolist()


def test_row_buckets_are_every_row_count_a_product_runs_at():
    from cairn.workers.model.packed_linear import padded_rows, row_buckets

    for most in (1, 2, 255, 256, 257, 2048, 3000):
        assert row_buckets(most) == sorted({padded_rows(n) for n in range(1, most + 1)})


def test_warm_up_runs_each_shape_at_each_bucket_and_the_head_at_the_sampled_rows(monkeypatch):
    from cairn.workers.model import packed_linear

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(16, 32), nn.Linear(16, 32), nn.Linear(32, 16)  # a and b: one shape
            self.lm_head = nn.Linear(16, 50, bias=False)

    model = Model()
    assert pack_linears(model) == 4
    seen = []
    original = PackedLinear.forward
    monkeypatch.setattr(PackedLinear, "forward", lambda self, x: seen.append((self.out_features, x.shape[0]))
                        or original(self, x))
    done = packed_linear.warm_up(model, max_rows=300, head_rows=4)
    body = packed_linear.row_buckets(300)
    assert sorted(seen) == sorted([(32, r) for r in body] + [(16, r) for r in body] + [(50, r) for r in (1, 2, 4)])
    assert done == len(seen)


def test_an_engine_warms_up_when_asked_and_answers_the_same(tmp_path):
    from cairn.workers.demo import demo_model_dir

    prompt, params = [3, 4, 5] * 20, SamplingParams(max_tokens=4, temperature=0)
    cold = Engine.from_pretrained(demo_model_dir("tiny", "qwen3_5"))
    warm = Engine.from_pretrained(demo_model_dir("tiny", "qwen3_5"), warm_up=True)
    assert warm.generate([prompt], params)[0].token_ids == cold.generate([prompt], params)[0].token_ids
    with pytest.raises(ValueError, match="warm_up"):
        Engine.from_pretrained(demo_model_dir("tiny", "qwen3_5"), warm_up="yes")
