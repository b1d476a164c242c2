"""Random-weight model configurations covering the supported architectures and attention layouts."""

from __future__ import annotations

from services.tools.random_model import RandomModelSpec

PARITY_SPECS = {
    "llama-gqa-8-2": RandomModelSpec(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2,
                                     num_heads=8, num_kv_heads=2, max_position_embeddings=512, init_std=0.15, seed=1),
    "llama-mqa": RandomModelSpec(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2,
                                 num_heads=8, num_kv_heads=1, max_position_embeddings=512, init_std=0.15, seed=2,
                                 tie_word_embeddings=True),
    "mistral": RandomModelSpec(architecture="MistralForCausalLM", vocab_size=512, hidden_size=128,
                               intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
                               max_position_embeddings=512, init_std=0.15, seed=3, rope_theta=1e6),
    "qwen2-bias": RandomModelSpec(architecture="Qwen2ForCausalLM", vocab_size=512, hidden_size=128,
                                  intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
                                  max_position_embeddings=512, init_std=0.15, seed=4),
    # Every matrix at or above the size from which fp32 weights are prepacked for oneDNN on a
    # CPU (services/runtime/model/linear.py), so parity covers the packed path too.
    "llama-wide-prepacked": RandomModelSpec(vocab_size=512, hidden_size=512, intermediate_size=1024, num_layers=1,
                                            num_heads=8, num_kv_heads=2, max_position_embeddings=512,
                                            init_std=0.05, seed=5),
}
