"""Adapters that let serving engines keep their KV cache in kvpool (vLLM's KV connector: `vllm`)."""
