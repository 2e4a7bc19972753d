"""The demo model made to measure speculative decoding on: its target trained a little on the demo
corpus, and its MTP head trained to the target's distribution over its own greedy continuations
(`cairn demo-model --mtp trained`). CPU, minutes, transformers' own modules (their torch paths),
in fp32.

Why the target is trained too: a random target's greedy continuation is chaotic. On the tiny
demo model, the best table lookup of token t + 2 from tokens (t, t + 1), fitted on 200 of its
continuations, predicts 6% of the next 100's (14% from t + 1 alone): no head accepts at a
realistic rate there. A few hundred steps of next-token training on the corpus give the target
text's structure (the same lookups: 75% and 52%), as a real model's continuations have.

`train_for_speculation(model_dir, ...)` rewrites `model_dir`'s weights in place:
1. the target: `target_steps` AdamW steps of next-token loss on windows of the demo corpus
   (cairn.workers.demo.corpus, tokenized by the checkpoint's tokenizer);
2. continuations: cairn's own engine decodes greedily after `prompts` corpus prompts;
3. the head (cairn.workers.model.mtp's layout, as published): its decoder layer starts as a
   copy of the target's last full-attention layer, its norms at 0 ((1 + w) norms: identity), `fc`
   at [0 | I] (the hidden half passed through); `head_steps` AdamW steps teach it, at each
   position t of a continuation, from the target's final hidden state at t and the embedding of
   token t + 1, the target's distribution of token t + 2 (cross-entropy to its softmax, through
   the target's LM head, frozen), as the engine applies it (cairn.workers.speculative.mtp_drafter).
   The distribution, not the greedy token alone: a sampled row's drafts are drawn from the head's
   distribution (cairn.workers.speculative), and a real head, trained with the LM loss on text,
   has one. Measured on tiny (12 held-out prompts, k = 2, one run each): the first draft of a
   row at temperature 0.6 kept 0.56 of the time drawn, 0.46 as the argmax (a head trained to the
   greedy token alone: 0.43 and 0.44); greedy rows keep 0.76 and 0.34 at the two positions
   (greedy labels: 0.80 and 0.30);
4. the checkpoint: the target's tensors under their names, the head's under `mtp.*`, and
   `mtp_num_hidden_layers: 1` in config.json.
Returns the head's top-1 accuracy on held-out continuations (what a greedy first draft would
keep). `RECIPE` names this recipe in the demo checkpoint's directory (a cached checkpoint of
another recipe is not reused: cairn.workers.demo.checkpoint).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

RECIPE = 2  # 1: the head trained to the greedy token; 2: to the target's distribution
WINDOW, BATCH = 64, 16  # tokens a training window, windows a step
PROMPT = 16  # tokens of each continuation's prompt (a corpus line's first)


class _Head(nn.Module):
    """The MTP head for training, over transformers' modules: (1 + w) norms, fc, one decoder
    layer (a copy of the target's last full-attention layer), norm."""

    def __init__(self, target: nn.Module):
        super().__init__()
        body = target.model
        hidden = target.config.get_text_config().hidden_size if hasattr(target.config, "get_text_config") \
            else target.config.hidden_size
        self.pre_fc_norm_embedding = copy.deepcopy(body.norm)
        self.pre_fc_norm_hidden = copy.deepcopy(body.norm)
        self.norm = copy.deepcopy(body.norm)
        for norm in (self.pre_fc_norm_embedding, self.pre_fc_norm_hidden, self.norm):
            nn.init.zeros_(norm.weight)
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        with torch.no_grad():
            self.fc.weight.zero_()
            self.fc.weight[:, hidden:] = torch.eye(hidden)
        full = [layer for layer in body.layers if getattr(layer, "layer_type", None) == "full_attention"
                or hasattr(layer, "self_attn")]
        self.layers = nn.ModuleList([copy.deepcopy(full[-1])])
        self.rotary = body.rotary_emb

    def forward(self, embeddings: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """embeddings, hidden [B, T, H]: token t + 1's embedding, the target's state at t."""
        x = self.fc(torch.cat((self.pre_fc_norm_embedding(embeddings), self.pre_fc_norm_hidden(hidden)), dim=-1))
        b, t, _ = x.shape
        positions = torch.arange(t)[None].expand(b, t)
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None].expand(b, 1, t, t)
        out = self.layers[0](x, position_embeddings=self.rotary(x, positions), attention_mask=mask,
                             position_ids=positions)
        return self.norm(out[0] if isinstance(out, tuple) else out)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The head's weights under their checkpoint names (`mtp.*`)."""
        return {f"mtp.{name}": t.detach().contiguous() for name, t in self.state_dict().items()
                if not name.startswith("rotary.")}


def train_for_speculation(model_dir: str | Path, target_steps: int = 300, head_steps: int = 400,
                          prompts: int = 256, new_tokens: int = 48, seed: int = 0,
                          log: Callable[[str], None] = lambda _: None) -> float:
    import transformers
    from tokenizers import Tokenizer

    from cairn.workers.demo.corpus import training_corpus

    model_dir = Path(model_dir)
    torch.manual_seed(seed)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    target = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    lines = [tokenizer.encode(line).ids for line in training_corpus(4000)]
    stream = torch.tensor([t for ids in lines for t in ids])

    target.train()
    optimizer = torch.optim.AdamW(target.parameters(), lr=3e-3)
    for step in range(target_steps):
        starts = torch.randint(0, len(stream) - WINDOW, (BATCH,))
        x = torch.stack([stream[s:s + WINDOW] for s in starts.tolist()])
        loss = target(input_ids=x, labels=x).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 100 == 0 or step == target_steps - 1:
            log(f"target step {step}: loss {loss.item():.3f}")
    target.eval()
    _save(model_dir, target, {})

    sequences = _continuations(model_dir, [ids[:PROMPT] for ids in lines if len(ids) >= PROMPT][:prompts], new_tokens)
    with torch.no_grad():
        batch = torch.tensor(sequences)
        states = target.model(input_ids=batch).last_hidden_state  # final normed hidden states
        target_logits = target.lm_head(states)
        greedy = target_logits.argmax(-1)  # the target's token after each position
        soft = torch.softmax(target_logits, -1)  # and its distribution there
    embed = target.get_input_embeddings()
    head = _Head(target)
    for p in target.parameters():
        p.requires_grad_(False)
    held_out = max(1, len(sequences) // 8)

    def loss_and_hits(rows: slice | torch.Tensor):
        tokens, hidden, labels = batch[rows], states[rows], greedy[rows]
        out = head(embed(tokens[:, 1:]), hidden[:, :-1])  # position t: state t, token t + 1
        logits = target.lm_head(out)
        want = labels[:, 1:]  # the target's token after t + 1
        loss = -(soft[rows][:, 1:] * torch.log_softmax(logits, -1)).sum(-1).mean()  # cross-entropy to p
        return loss, (logits.argmax(-1) == want).float().mean().item()

    optimizer = torch.optim.AdamW(head.parameters(), lr=2e-3)
    train_rows = len(sequences) - held_out
    for step in range(head_steps):
        rows = torch.randint(0, train_rows, (BATCH,))
        loss, hits = loss_and_hits(rows)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 100 == 0 or step == head_steps - 1:
            log(f"head step {step}: loss {loss.item():.3f}, top-1 {hits:.2f}")
    with torch.no_grad():
        _, accuracy = loss_and_hits(slice(train_rows, len(sequences)))
    log(f"head top-1 on held-out continuations: {accuracy:.2f}")
    _save(model_dir, target, head.tensors())
    return accuracy


def _continuations(model_dir: Path, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Each prompt and the target's greedy tokens after it, from cairn's engine."""
    from cairn.workers import Engine, SamplingParams

    engine = Engine.from_pretrained(model_dir, dtype="float32", max_num_seqs=min(len(prompts), 128))
    outs = engine.generate(prompts, SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True))
    return [p + o.token_ids for p, o in zip(prompts, outs)]


def _save(model_dir: Path, target: nn.Module, head: dict[str, torch.Tensor]) -> None:
    tensors = {name: t.detach().contiguous() for name, t in target.state_dict().items()}
    if target.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    tensors.update(head)
    save_file(tensors, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    (model_dir / "model.safetensors").chmod(0o644)  # as write_demo_model leaves it: other users read it too
    if head:
        path = model_dir / "config.json"
        config = json.loads(path.read_text())
        config.get("text_config", config)["mtp_num_hidden_layers"] = 1
        path.write_text(json.dumps(config, indent=2) + "\n")
