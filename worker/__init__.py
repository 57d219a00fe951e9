"""The engine: model loading and forward, paged KV cache, scheduler, sampler and the engine loop."""
