"""The shared base-model engine. Knows nothing of HTTP, databases or tenants' keys."""
