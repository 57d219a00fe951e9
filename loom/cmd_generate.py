"""``loom generate``: stream one completion to the terminal.

With ``--api-key`` it calls a Loom gateway (``--address``, or ``LOOM_ADDRESS``, default
127.0.0.1:50051). ``--local`` runs the engine in this process instead, no server needed.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import sys
import time
from typing import Any

from gateway.settings import ClientSettings
from protocol.engine_config import EngineConfig


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("generate", help="stream a completion for PROMPT")
    p.add_argument(
        "prompt", help="the prompt: a user message (the model's chat template applies), or --raw text"
    )
    client = ClientSettings()
    p.add_argument("--api-key", default=client.api_key, help="tenant API key (or LOOM_API_KEY)")
    p.add_argument("--address", default=client.address, help="gateway host:port (or LOOM_ADDRESS)")
    p.add_argument("--tls-ca", default=None, help="CA certificate of a TLS gateway")
    p.add_argument("--local", action="store_true", help="run the engine in this process; no server, no key")
    p.add_argument(
        "--model",
        default=None,
        help="remote: a model id (default: the first listed); --local: a .gguf file or HF directory",
    )
    p.add_argument(
        "--raw", action="store_true", help="send the prompt as raw text, without the chat template"
    )
    p.add_argument("--chat", action="store_true", help=argparse.SUPPRESS)  # the default; kept for old scripts
    p.add_argument("--priority", choices=["interactive", "standard", "batch"], default=None)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 means greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.local:
        return _run_local(args)
    if not args.api_key:
        print("loom generate: pass --api-key (or set LOOM_API_KEY), or use --local", file=sys.stderr)
        return 2
    return asyncio.run(_run_remote(args))


async def _run_remote(args: argparse.Namespace) -> int:
    import grpc

    from gateway.grpc.client import LoomClient

    fields: dict[str, Any] = {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "stop": args.stop,
    }
    if args.top_p != 1.0:
        fields["top_p"] = args.top_p
    if args.top_k:
        fields["top_k"] = args.top_k
    if args.seed is not None:
        fields["seed"] = args.seed
    if args.priority:
        fields["priority"] = f"PRIORITY_{args.priority.upper()}"
    if args.tls_ca is None and not _is_loopback(args.address):
        print(
            f"loom generate: warning: no --tls-ca, so the API key goes to {args.address} in plaintext; "
            "anyone on the network path can read it",
            file=sys.stderr,
        )
    async with LoomClient.from_files(args.address, args.api_key, args.tls_ca) as client:
        try:
            model = args.model or next(iter(await client.list_models())).id
            final = None
            if args.raw:
                stream = client.generate(model, prompt=args.prompt, **fields)
            else:
                stream = client.generate(model, messages=[("user", args.prompt)], **fields)
            async for chunk in stream:
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                if chunk.HasField("usage"):
                    final = chunk
        except grpc.aio.AioRpcError as err:
            print(f"\nloom generate: {err.code().name}: {err.details()}", file=sys.stderr)
            return 1
        except StopIteration:
            print("loom generate: this key may use no model", file=sys.stderr)
            return 1
    print(flush=True)
    if final is not None:
        u = final.usage
        print(f"[{u.prompt_tokens} prompt + {u.completion_tokens} completion tokens]", file=sys.stderr)
    return 0


def _is_loopback(address: str) -> bool:
    """Whether ``host:port`` names this machine (a key sent there in plaintext crosses no network)."""
    host = address.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _run_local(args: argparse.Namespace) -> int:
    from protocol.model_config import UnsupportedModelError
    from protocol.model_files import CheckpointError
    from protocol.requests import GenerationRequest, InvalidRequestError, SamplingParams
    from worker.api import LLMEngine

    settings = EngineConfig(model_path=args.model) if args.model else EngineConfig()
    try:
        sampling = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            stop=tuple(args.stop),
        )
        started = time.monotonic()
        print("loading model ...", file=sys.stderr, flush=True)
        engine = LLMEngine(settings)
        print(
            f"loaded {engine.model_name} in {time.monotonic() - started:.1f} s "
            f"({engine.device.type}, {str(engine.dtype).removeprefix('torch.')})",
            file=sys.stderr,
            flush=True,
        )
        tok = engine.tokenizer
        chat = [{"role": "user", "content": args.prompt}]
        ids = tok.encode(args.prompt) if args.raw else tok.encode_chat(chat)
        engine.add_request(GenerationRequest("cli", ids, sampling))
    except (InvalidRequestError, CheckpointError, UnsupportedModelError, ValueError) as exc:
        print(f"loom generate: {exc}", file=sys.stderr)
        return 2

    t0 = time.monotonic()
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            sys.stdout.write(out.text)
            sys.stdout.flush()
            if out.finished:
                final = out
    elapsed = time.monotonic() - t0
    print(flush=True)
    if final is not None:
        rate = final.completion_tokens / elapsed if elapsed > 0 else 0.0
        print(
            f"[{final.finish_reason}: {final.prompt_tokens} prompt + "
            f"{final.completion_tokens} completion tokens, {rate:.1f} tokens/s]",
            file=sys.stderr,
        )
    return 0
