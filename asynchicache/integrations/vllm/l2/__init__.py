"""integrations.vllm.l2."""
