"""What one engine step must move and compute at full size, split by the kernel class that does
it, and how long that takes on a GPU: at the GPU's limit, or at the efficiencies a
`benchmarks/kernel_speed.py --json-out` run measured (a calibration).

The steps (`STEPS`): decode at 1, 64 and 256 running sequences, one 4k-token prefill, 16 x
256-token prefills, a mixed step of 64 decodes and a 512-token prefill, and verify steps
(speculative decoding, k = 2 drafted tokens after each of 1, 64, 256 decoding sequences: each
sequence's 3 tokens a chunk of the prefill path, every position sampled, then the MTP head's
drafting, `mtp head`: its pass over the step's 3 positions a sequence and one more application a
further draft, each one decoder layer, `fc` and the LM head; at 1 and 64 also in the exact mode,
"exact": each sequence's 3 tokens decode rows, level by level, each reading its context and
stepping the recurrent state, the states after the first two copied, and graphed on a GPU as
decode steps are). `step_work` counts one
tensor-parallel rank's bytes and FLOPs at full size (bf16 weights and K/V, fp32 delta-rule states,
`context` tokens of K/V per decoding sequence) in these classes: the kernel ops of kernel_speed.py,
by the same names (`KERNEL_CLASSES`), "dense GEMMs" (every projection, the router, the LM head:
cuBLAS, which kernel_speed does not time) and "other" (activations through norms, rotary and gates,
about 16 reads or writes of a row per layer). Each class also says how many tokens its kernels take.

    limit      = max(all bytes / bandwidth, all FLOPs / peak)           every kernel at its limit
    calibrated = sum over classes of max(bytes / bandwidth, FLOPs / peak) / efficiency

A class's efficiency (`Calibration.efficiency`) is kernel_speed's `fraction_of_limit` for the op of
that name, at its case whose token count is nearest the class's (by ratio); a class the file does
not measure takes `ASSUMED` (dense GEMMs, other) or `DEFAULT_EFFICIENCY`, and says so.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from cairn.workers.model.model_config import ModelConfig
from cairn.workers.model.sharding import shard_config

CONTEXT = 4096  # tokens of context each decoding sequence is assumed to hold (the limit's K/V reads)
KERNEL_CLASSES = ("decode attention", "prefill attention", "store_kv", "recurrent step", "chunked delta rule",
                  "conv1d update", "conv1d varlen", "moe experts")
ASSUMED = {"dense GEMMs": 0.7, "other": 0.5, "mtp head": 0.7}  # cuBLAS at serving shapes; row-wise ops;
# the MTP head: its LM head and projections are dense GEMMs too
DEFAULT_EFFICIENCY = 0.5  # a kernel class the calibration file does not measure


@dataclass(frozen=True)
class Step:
    name: str
    decodes: int  # sequences already running (one token each in the step)
    prefills: tuple[int, ...]  # prompt lengths prefilled in the step
    drafts: int = 0  # tokens drafted after each decoding sequence's (a verify step)
    exact: bool = False  # the verify rows as decode rows, level by level (`speculative_exact`; graphed)


STEPS = (Step("decode x1", 1, ()), Step("decode x64", 64, ()), Step("decode x256", 256, ()),
         Step("prefill 4k", 0, (4096,)), Step("prefill 16x256", 0, (256,) * 16),
         Step("mixed 64+512", 64, (512,)), Step("verify x1 k=2", 1, (), 2), Step("verify x64 k=2", 64, (), 2),
         Step("verify x256 k=2", 256, (), 2), Step("verify x1 k=2 exact", 1, (), 2, True),
         Step("verify x64 k=2 exact", 64, (), 2, True))
QUICK_STEPS = ("decode x64", "prefill 4k", "mixed 64+512")


@dataclass(frozen=True)
class Work:
    bytes: float
    flops: float
    tokens: int  # tokens the class's kernels take in the step: what a calibration is looked up by

    def limit_s(self, gpu: dict) -> float:
        return max(self.bytes / gpu["bandwidth"], self.flops / gpu["flops"])


def step_work(cfg: ModelConfig, tp: int, step: Step, context: int = CONTEXT) -> dict[str, Work]:
    """One rank's work in `step` by class (classes with nothing to do left out)."""
    c = shard_config(cfg, tp)
    H, E, top, L = c.hidden_size, c.num_experts, c.num_experts_per_tok, c.num_hidden_layers
    n_att, n_lin = len(c.attention_layers), len(c.linear_layers)
    k = step.drafts
    speculating = step.decodes if k else 0  # sequences verifying drafts
    if k and step.exact:  # each drafted token a decode row, level by level, the states after each copied
        verify, decodes, saves = 0, step.decodes * (1 + k), k * step.decodes
    else:  # a verify's rows go the prefill path
        verify, decodes, saves = (step.decodes, 0, 0) if k else (0, step.decodes, 0)
    chunked = [1 + k] * verify + list(step.prefills)  # segments of the prefill path
    prefill_tokens, prefill_seqs = sum(chunked), len(chunked)
    tokens = decodes + prefill_tokens
    sampled = decodes + len(step.prefills) + verify * (1 + k)
    attn = H * c.num_attention_heads * c.head_dim * 2 + 2 * H * c.num_key_value_heads * c.head_dim + \
        c.num_attention_heads * c.head_dim * H  # q and its gate, k, v, o
    delta = H * (2 * c.key_dim + 2 * c.value_dim + 2 * c.linear_num_value_heads) + c.value_dim * H
    router = H * E + H  # the router and the shared expert's gate
    vocab_rows = -(-c.vocab_size // tp)
    dense = n_att * attn + n_lin * delta + L * router
    expert, shared = 3 * H * c.moe_intermediate_size, 3 * H * c.shared_expert_intermediate_size
    touched = E * (1 - (1 - top / E) ** tokens)  # distinct experts a layer's tokens reach
    kv_token = 2 * c.num_key_value_heads * c.head_dim * 2 * n_att  # bytes of a token's K and V, all layers
    pair_flops = 4 * n_att * c.num_attention_heads * c.head_dim  # QK and PV of one (query, key) pair
    state = n_lin * c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4  # fp32
    delta_flops = 8 * n_lin * c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim
    conv_weights = 2 * n_lin * c.conv_dim * c.linear_conv_kernel_dim
    conv_state = n_lin * c.conv_dim * (c.linear_conv_kernel_dim - 1) * 2
    conv_flops = 2 * n_lin * c.conv_dim * c.linear_conv_kernel_dim
    # activations a class's kernels read and write per token (bf16; the gates fp32), as kernel_speed
    # counts them, so that its measured fractions apply to these bytes
    conv_rows = n_lin * 2 * c.conv_dim * 2  # the conv's input and output
    delta_rows = n_lin * ((2 * c.key_dim + 2 * c.value_dim) * 2 + 2 * c.linear_num_value_heads * 4)  # q k v out, g beta
    query_rows = n_att * 2 * c.num_attention_heads * c.head_dim * 2  # the query read, the output written
    pair_rows = L * top * (H + 2 * c.moe_intermediate_size + 2 * H) * 2  # x read; inter and a down row written, read
    work = {
        "dense GEMMs": Work(2 * (dense + vocab_rows * H), 2 * tokens * dense + 2 * sampled * vocab_rows * H, tokens),
        "moe experts": Work(2 * L * (touched * expert + shared) + tokens * pair_rows,
                            2 * tokens * L * (top * expert + shared), tokens),
        "store_kv": Work(2 * kv_token * tokens, 0, tokens),  # read from the projections, written to pages
        "decode attention": Work(kv_token * decodes * context + query_rows * decodes, pair_flops * decodes * context,
                                 decodes),
        "prefill attention": Work((kv_token + query_rows) * prefill_tokens + kv_token * verify * context,
                                  pair_flops * (sum(n * n / 2 for n in step.prefills) + verify * (1 + k) * context),
                                  prefill_tokens),
        "recurrent step": Work(2 * (decodes + saves) * state + delta_rows * decodes, delta_flops * decodes, decodes),
        "chunked delta rule": Work((2 * prefill_seqs + k * verify) * state + delta_rows * prefill_tokens,
                                   delta_flops * prefill_tokens, prefill_tokens),  # (a verify keeps k states)
        "conv1d update": Work(conv_weights + 2 * (decodes + saves) * conv_state + conv_rows * decodes,
                              conv_flops * decodes, decodes),
        "conv1d varlen": Work(conv_weights + 2 * prefill_seqs * conv_state + conv_rows * prefill_tokens,
                              conv_flops * prefill_tokens, prefill_tokens),
        "other": Work(tokens * L * H * 2 * 16, 0, tokens),
    }
    if k:  # the head: over the 1 + k positions a sequence, then k - 1 more applications
        layer = attn // n_att + router + (top * expert + shared if E else 3 * H * c.intermediate_size)
        weights = layer + 2 * H * H + vocab_rows * H
        rows = speculating * (1 + k) + speculating * (k - 1)
        head_kv = 2 * c.num_key_value_heads * c.head_dim * 2  # one attention layer's K and V of a token
        work["mtp head"] = Work(2 * k * (weights - top * expert + touched * expert) + head_kv * speculating * context * k,
                                2 * rows * weights + pair_flops / n_att * rows * context, rows)
    return {kind: w for kind, w in work.items() if w.tokens}


def limit_s(work: dict[str, Work], gpu: dict) -> float:
    """Every kernel at the GPU's limit, the step's bytes and FLOPs taken together."""
    return max(sum(w.bytes for w in work.values()) / gpu["bandwidth"],
               sum(w.flops for w in work.values()) / gpu["flops"])


@dataclass(frozen=True)
class Efficiency:
    fraction: float  # of the class's limit
    measured_at: str | None  # the kernel_speed case it comes from; None: assumed


class Calibration:
    """The efficiencies of one kernel_speed.py --json-out file (its schema: kernel_speed's doc)."""

    def __init__(self, gpu: str, ops: dict[str, list[dict]], source: str):
        self.gpu, self.ops, self.source = gpu, ops, source

    @classmethod
    def read(cls, path: str | Path) -> Calibration:
        data = json.loads(Path(path).read_text())
        return cls(data["gpu"], data["ops"], str(path))

    def efficiency(self, kind: str, tokens: int) -> Efficiency:
        cases = [c for c in self.ops.get(kind, ()) if c.get("fraction_of_limit")]
        if not cases:
            return Efficiency(ASSUMED.get(kind, DEFAULT_EFFICIENCY), None)
        case = min(cases, key=lambda c: abs(math.log(max(c["tokens"], 1) / max(tokens, 1))))
        return Efficiency(case["fraction_of_limit"], case["shape"])


def calibrated_s(work: dict[str, Work], gpu: dict, calibration: Calibration) -> tuple[float, dict[str, Efficiency]]:
    """The step's kernels at the calibration's efficiencies, and the efficiency each class took."""
    taken = {kind: calibration.efficiency(kind, w.tokens) for kind, w in work.items()}
    return sum(w.limit_s(gpu) / taken[kind].fraction for kind, w in work.items()), taken
