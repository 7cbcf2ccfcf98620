"""Using trained models: KV-cache decoding, text generation, and the lm-evaluation-harness adapter."""
