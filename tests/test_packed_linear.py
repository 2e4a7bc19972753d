"""CPU linears packed for oneDNN compute what `F.linear` computes, and only the linears whose
weights nothing else reads are packed: a tied LM head and the MoE's shared expert stay plain."""

import pytest
import torch
import torch.nn.functional as F
from conftest import build_hf_checkpoint, hf_reference_model
from torch import nn

from workers import Engine, SamplingParams
from workers.model.packed_linear import PackedLinear, can_pack, pack_linears

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
