"""The OpenAI-compatible HTTP front: a thin adapter over the request path, beside gRPC.

``POST /v1/chat/completions`` and ``POST /v1/completions`` (server-sent events ending with
``data: [DONE]``, or one JSON answer), ``GET /v1/models`` and ``GET /health``, under FastAPI and
uvicorn in the gateway's own event loop. It only translates; every rule is the path's.

* ``schema``: the request and response bodies (pydantic; they document ``/openapi.json``);
* ``endpoints``: how each endpoint decodes its body and encodes deltas (chat, completions);
* ``errors``: a refusal as an HTTP status and OpenAI's error object;
* ``body``: reading a body under its size limit, decoding it with bounded error lists;
* ``streaming``: server-sent events under a stall guard, and answers cut short by a client leaving;
* ``app``: the FastAPI application and its routes; ``server``: uvicorn, TLS renewal.
"""
