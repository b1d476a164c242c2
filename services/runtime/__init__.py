"""The model runtime (torch): model, kernels, sampler and KV cache layout, used by the processes that run models (executor, drafter)."""
