"""Demo checkpoints: random-weight hybrid models (Qwen3-Next, Qwen3.5 dense and MoE) with a real
tokenizer and chat template.

`write_demo_model(out_dir, size="tiny", seed=0, arch="qwen3_next")` writes one in Hugging Face
layout; tests use "tiny", CPU benchmarks "bench". No weights or data come from a hub.
"""

from cairn.workers.demo.checkpoint import demo_model_dir, write_demo_model

__all__ = ["demo_model_dir", "write_demo_model"]
