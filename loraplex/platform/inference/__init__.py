"""The OpenAI-compatible request path: admit (quota) -> run on the engine -> settle and record usage."""
