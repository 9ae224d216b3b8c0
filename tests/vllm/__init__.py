"""Tests against the real vLLM engine (marked `vllm`; skipped where vLLM is not installed)."""
