"""The MTP head (cairn/workers/model/mtp.py) against an independent reference written here from
the published architecture: transformers' own decoder layer of the family (full attention, the
model's MLP at its first layer) inside the head's wrapper (the two (1 + w) RMSNorms, the
embedding-then-hidden concatenation, the 2H -> H projection, the final norm, the target's LM
head). The checkpoints are transformers' own, with `mtp.*` tensors added under the published
names (per-expert MoE tensors where the family's decoder layer keeps them fused: the loader fuses
both). cairn's head runs over a prefill of 37 tokens through its paged K/V, as the engine's
layers do."""

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from cairn.kernels import VarlenPlan
from cairn.workers.execution.step_work import StepWork
from cairn.workers.model import ModelCaches, read_model_config
from cairn.workers.model.mtp import load_mtp
from cairn.workers.model.model_config import CheckpointError
from tests.support.mtp_checkpoint import with_mtp

T, PAGE = 37, 16


def rms_1p(x, w, eps):
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w.float())


def one_prefill(n: int, gqa: int) -> StepWork:
    """One sequence's prefill of n tokens over pages 0, 1, ...: the step as the runner lays it out."""
    pages = -(-n // PAGE)
    positions = np.arange(n, dtype=np.int64)
    return StepWork(
        input_ids=np.zeros(n, np.int64), positions=positions, cu_seqlens=np.array([0, n], np.int32),
        seq_lens=np.array([n], np.int32), page_table=np.arange(pages, dtype=np.int32)[None, :],
        slot_mapping=positions.copy(), state_slots=np.array([0], np.int64), num_decodes=0,
        logits_indices=np.arange(n, dtype=np.int64), prefill=VarlenPlan.build([0, n], [[]], gqa),
        checkpoint_rows=np.zeros((0, 3), np.int64), checkpoint_targets=np.zeros(0, np.int64),
        checkpoint_states=np.zeros(0, np.int64))


@pytest.mark.parametrize("kind", ["moe", "dense", "q35_moe", "q35_dense"])
def test_the_mtp_head_matches_the_published_architecture(tmp_path, kind):
    from tests.support.checkpoints import build_hf_checkpoint

    path = build_hf_checkpoint(tmp_path / kind, kind)
    layer, rotary, head, text = with_mtp(path, kind)
    cfg = read_model_config(path / "config.json")
    weights = load_file(path / "model.safetensors")
    embed = next(v for k, v in weights.items() if k.endswith("embed_tokens.weight")).float()
    lm_head = weights.get("lm_head.weight", embed).float()

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (T,), generator=g)
    hidden = torch.randn(T, cfg.hidden_size, generator=g)  # the target's final hidden states

    eps = cfg.rms_norm_eps
    x = torch.cat((rms_1p(embed[ids], head["pre_fc_norm_embedding.weight"], eps),
                   rms_1p(hidden, head["pre_fc_norm_hidden.weight"], eps)), dim=-1) @ head["fc.weight"].T
    position_ids = torch.arange(T)[None]
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        out = layer(x[None], position_embeddings=rotary(x[None], position_ids), attention_mask=mask,
                    position_ids=position_ids)
        y = out[0] if isinstance(out, tuple) else out
    expected = rms_1p(y[0], head["norm.weight"], eps) @ lm_head.T

    mtp = load_mtp(path, cfg, torch.float32, "cpu", cache_rank=0)
    work = one_prefill(T, cfg.num_attention_heads // cfg.num_key_value_heads)
    batch = work.batch({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in work.arrays().items()})
    kv = [(torch.zeros(-(-T // PAGE), PAGE, cfg.num_key_value_heads, cfg.head_dim) for _ in range(2))]
    caches = ModelCaches([tuple(kv[0])], torch.zeros(0), torch.zeros(0))
    with torch.inference_mode():
        got = mtp(embed[ids], hidden, batch, caches) @ lm_head.T
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=1e-4)
    assert caches.kv[0][0].abs().sum() > 0  # the head wrote its own K/V


def test_a_checkpoint_without_a_head_has_none_and_a_broken_head_is_refused(tmp_path):
    from tests.support.checkpoints import build_hf_checkpoint

    path = build_hf_checkpoint(tmp_path / "plain", "dense")
    cfg = read_model_config(path / "config.json")
    assert load_mtp(path, cfg, torch.float32, "cpu", 0) is None
    with_mtp(path, "dense")
    weights = path / "model.safetensors"
    tensors = load_file(weights)
    tensors.pop("mtp.fc.weight")
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="mtp.fc.weight"):
        load_mtp(path, cfg, torch.float32, "cpu", 0)
