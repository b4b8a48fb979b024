"""pagefleet: Kubernetes-native LLM serving with a paged-KV engine and a global prefix index."""

__version__ = "0.1.0"
