"""KV-aware routing: the engines' KV cache events, the index built from them, and the policy."""
