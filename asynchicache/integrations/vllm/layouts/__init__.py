"""integrations.vllm.layouts."""
