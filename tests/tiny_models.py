"""Tiny random models of each family as transformers saves them (config.json, safetensors, and
the bundled model's tokenizer.json), the references the family tests hold the workbench to.

Random weights at transformers' init are near-uniform: its logits sit within a hair of each
other and any rounding flips the argmax. The weights here are drawn wider (initializer_range
0.2) and the norms and biases random too (all-ones norms would hide a wrong Gemma offset),
so the predictions are decided by margins far above fp32 rounding."""

from __future__ import annotations

from pathlib import Path

import torch

# Each family's config beyond the common shapes, as the models set them: Mistral's
# window shorter than the 140-token text, Gemma 3's local and global layers, Phi-4-mini's
# partial rotary with long-context RoPE, Qwen2 with its window turned on above layer 1.
FAMILIES = {
    "llama": ("LlamaConfig", dict(rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                   "original_max_position_embeddings": 64})),
    "mistral": ("MistralConfig", dict(sliding_window=48, head_dim=16)),
    "qwen2": ("Qwen2Config", dict()),
    "qwen2-window": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=32, max_window_layers=1)),
    "qwen3": ("Qwen3Config", dict(head_dim=24)),
    "gemma3": ("Gemma3TextConfig", dict(head_dim=16, sliding_window=24, query_pre_attn_scalar=20, pad_token_id=0,
                                        layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
    "phi3": ("Phi3Config", dict(pad_token_id=0, sliding_window=None, original_max_position_embeddings=256,
                                max_position_embeddings=1024,
                                rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                                 "partial_rotary_factor": 0.75,
                                                 "short_factor": [1.0 + 0.1 * i for i in range(6)],
                                                 "long_factor": [2.0 + 0.5 * i for i in range(6)]})),
}


def save_tiny(family: str, folder: Path, tokenizer, seed: int = 0, **overrides):
    """A tiny random `family` model saved to `folder` as transformers writes it; returns the
    transformers model (fp32, eval)."""
    import transformers

    class_name, extra = FAMILIES[family]
    common = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=tokenizer.vocab_size, max_position_embeddings=512,
                  bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, initializer_range=0.2)
    cfg = getattr(transformers, class_name)(**{**common, **extra, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # Gemma's are offsets from 1
                p.normal_(0.0 if family == "gemma3" else 1.0, 0.2)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.2)
    model.save_pretrained(folder)
    tokenizer.backend.save(str(Path(folder) / "tokenizer.json"))
    return model
