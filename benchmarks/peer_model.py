"""The model the peer benchmark serves on all three systems: the `bench` demo shape (Qwen3.5
architecture) with Qwen2's vocabulary, in Hugging Face layout and as a GGUF for llama-server.

Why a vocabulary of its own: llama.cpp's converter (`convert_hf_to_gguf.py`) names a BPE
pre-tokenizer by hashing the token ids its tokenizer gives for a fixed test text, and refuses a
tokenizer whose hash it does not know. The demo tokenizer, trained here with 4,096 tokens, matches
none. llama.cpp's source ships vocabulary-only GGUFs of the tokenizers it knows
(`models/ggml-vocab-qwen2.gguf`): its 151,643 byte-level BPE tokens and 151,387 merges, with
Qwen2's split regex (the demo tokenizer's too) and NFC, give the ids of Qwen2's own tokenizer, so
the converter recognises it as `qwen2`, unpatched. The control tokens sit at the ids Qwen3 gives
them (<|endoftext|> 151643 ... </think> 151668), inside the 151,936 embedding rows.

Contract:
- `qwen2_tokenizer(llama_dir)` reads the vocabulary GGUF with the gguf package llama.cpp's source
  carries (gguf-py; nothing installed) and returns a `tokenizers.Tokenizer` with the demo
  tokenizer's control tokens (special ones special; think and tool tags added, not special).
- `write_peer_model(out_dir, llama_dir)` writes the checkpoint (`write_demo_model` with that
  tokenizer: the same weights' recipe, seed 0), then `<out_dir>.gguf` in bf16 with llama.cpp's
  converter, run as a subprocess from its own source tree. Both are skipped where present.
- Run as a script (`python3 benchmarks/peer_model.py [LLAMA_DIR]`, which peers_setup.sh does):
  writes $CAIRN_PEERS/peer-bench (and peer-bench.gguf) and prints both paths.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tokenizers import Tokenizer, models, normalizers  # noqa: E402

from cairn.workers.demo.demo_tokenizer import add_control_tokens, byte_level_bpe  # noqa: E402

PEERS = Path(os.environ.get("CAIRN_PEERS") or Path.home() / ".cache" / "cairn-peers")
NAME = "peer-bench"
VOCAB_SIZE = 151_936  # Qwen2's and Qwen3's embedding rows
# The ids Qwen3's tokenizer gives its control tokens.
CONTROL_IDS = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645,
               "<tool_call>": 151657, "</tool_call>": 151658, "<tool_response>": 151665,
               "</tool_response>": 151666, "<think>": 151667, "</think>": 151668}
NORMAL = 1  # gguf's TokenType.NORMAL: a BPE token (the others are control and padding)


def qwen2_tokenizer(llama_dir: Path) -> Tokenizer:
    sys.path.insert(0, str(llama_dir / "gguf-py"))
    import gguf

    reader = gguf.GGUFReader(str(llama_dir / "models" / "ggml-vocab-qwen2.gguf"))

    def strings(key: str) -> list[str]:
        field = reader.fields[key]
        return [bytes(field.parts[i]).decode("utf-8") for i in field.data]

    types_field = reader.fields["tokenizer.ggml.token_type"]
    types = [int(types_field.parts[i][0]) for i in types_field.data]
    vocab = {token: i for i, token in enumerate(strings("tokenizer.ggml.tokens")) if types[i] == NORMAL}
    vocab.update(CONTROL_IDS)  # added below with the same contents: the tokens keep these ids
    merges = [tuple(m.split(" ", 1)) for m in strings("tokenizer.ggml.merges")]
    tokenizer = byte_level_bpe(models.BPE(vocab=vocab, merges=merges))
    tokenizer.normalizer = normalizers.NFC()
    add_control_tokens(tokenizer)
    for token, i in CONTROL_IDS.items():
        if tokenizer.token_to_id(token) != i:
            raise RuntimeError(f"{token} took id {tokenizer.token_to_id(token)}, not Qwen3's {i}")
    return tokenizer


def write_peer_model(out_dir: Path, llama_dir: Path) -> tuple[Path, Path]:
    from cairn.workers.demo.checkpoint import write_demo_model

    if not (out_dir / "model.safetensors").exists():
        write_demo_model(out_dir, size="bench", arch="qwen3_5", tokenizer=qwen2_tokenizer(llama_dir),
                         vocab_size=VOCAB_SIZE)
    gguf_path = out_dir.with_name(out_dir.name + ".gguf")
    if not gguf_path.exists():
        env = dict(os.environ, PYTHONPATH=str(llama_dir / "gguf-py"), HF_HUB_OFFLINE="1")
        subprocess.run([sys.executable, str(llama_dir / "convert_hf_to_gguf.py"), str(out_dir),
                        "--outtype", "bf16", "--no-mtp", "--outfile", str(gguf_path)], env=env, check=True, cwd=llama_dir)
    return out_dir, gguf_path


if __name__ == "__main__":
    llama = Path(sys.argv[1]) if len(sys.argv) > 1 else PEERS / "llama.cpp"
    for path in write_peer_model(PEERS / NAME, llama):
        print(path)
