"""Names vulture reports as unused that are used from outside Python's reach: framework hooks,
entry points named in configuration, and attributes set on library objects. `make lint` runs vulture
with this file; anything else it reports is dead code to delete."""

# Ray Serve calls these on deployment replicas and on request routers.
record_routing_stats  # serving.replica.EngineReplica
record_autoscaling_stats  # serving.replica.EngineReplica
check_health  # serving.replica.EngineReplica, serving.ingress.GatewayIngress
LoomRequestRouter  # serving.router, named by ROUTER_CLASS as an import path
initialize_state  # serving.router.LoomRequestRouter
choose_replicas  # serving.router.LoomRequestRouter
on_request_routed  # serving.router.LoomRequestRouter

# grpc.aio calls this on server interceptors.
intercept_service  # gateway.grpc.auth.AuthInterceptor

# KubeRay's RayService imports it (serveConfigV2.applications[].import_path = "serving.app:build_app").
build_app  # serving.app

# Attributes set on HF `tokenizers` objects, read by the library.
pre_tokenizer  # protocol.tokenizer, loadtest.tiny_model
decoder  # protocol.tokenizer, loadtest.tiny_model
encode_special_tokens  # protocol.tokenizer

# pydantic validators, called by pydantic.
_coherent  # tenancy.models
_models_non_empty  # tenancy.models
_bounds  # loadtest.workload
_weights  # loadtest.workload
_burst_fits  # loadtest.workload
_mix  # loadtest.workload
_no_sweep  # loadtest.workload
_no_driver  # loadtest.workload

# pytest hooks, called by pytest.
pytest_configure  # tests/conftest.py
pytest_collection_modifyitems  # tests/conftest.py

# FastAPI reads an application's openapi (gateway/http/app.py documents the hand-read bodies there).
openapi  # gateway.http.app

# pytest fixtures requested by name.
ray_serve  # tests/gateway/conftest.py

# Stored fields of tenancy records, written by the stores and shown by `loom admin`.
updated_at  # tenancy.models.Tenant
added_at  # tenancy.models.AdapterRecord

# FastAPI routes (registered by decorator) and uvicorn attributes the HTTP front sets.
chat_completions  # gateway.http.app
completions  # gateway.http.app
models  # gateway.http.app
health  # gateway.http.app
capture_signals  # uvicorn.Server
should_exit  # uvicorn.Server

# Fields of OpenAI response bodies (gateway/http/schema.py): serialized for clients, never read here.
cached_tokens
prompt_tokens_details
text_offset
owned_by

# pydantic validators, called by pydantic (continued).
_tls_is_whole  # gateway.settings.GatewaySettings
_one_text_prompt  # gateway.http.schema.CompletionRequest

# pytest fixtures requested by name (continued).
folder_ray  # tests/faults/conftest.py
nan_buffers  # tests/kernels/test_triton_lora.py

# Request-body fields read by name (getattr over a list of names) in gateway.http.endpoints, or
# accepted for the OpenAI shape and not needed (a tool message's tool_call_id: results are matched
# to calls by their order in the conversation, as the model's chat template does).
json_  # gateway.http.schema.StructuredOutputs
guided_json  # gateway.http.schema._Sampling
guided_regex  # gateway.http.schema._Sampling
guided_choice  # gateway.http.schema._Sampling
guided_grammar  # gateway.http.schema._Sampling
tool_call_id  # gateway.http.schema.ChatMessageIn
_ngram_range  # protocol.engine_config.EngineConfig (a pydantic validator)
