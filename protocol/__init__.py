"""What crosses the engine's boundary, in plain data: the only part of the engine that the gateway,
the serving layer's routers and every client import.

Requests and their sampling parameters, streamed outputs, the limits both sides check, the stats a
replica publishes, the commands an engine thread takes, how an engine is configured, and what a
checkpoint's files say without its weights (shapes, tokenizer, chat template, LoRA adapter shapes).
Nothing here imports torch, Ray or gRPC (import-linter holds it), so a gateway process or
``loom admin`` never pays for the engine.
"""
