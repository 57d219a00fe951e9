"""Tokenizer and chat template, from the same checkpoint as the weights."""

from __future__ import annotations

import functools
import json
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers


class TemplateError(ValueError):
    """The chat template refused the conversation (for example, roles out of order)."""


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


# HF tokenizers' ``encode`` holds the GIL for all of its work (about a second for a 1 MB prompt), which
# stalls every other thread, the gateway's event loop included, even when called from a worker thread;
# ``encode_batch`` releases it while the Rust code runs. Same ids; below this size the call is too short
# to matter (loadtest/bench_isolation.py measures the stall).
_RELEASE_GIL_CHARS = 16 * 1024


def _encode_ids(backend: HFTokenizer, text: str) -> list[int]:
    if len(text) < _RELEASE_GIL_CHARS:
        return backend.encode(text, add_special_tokens=False).ids
    return backend.encode_batch([text], add_special_tokens=False)[0].ids


@dataclass
class Tokenizer:
    """Encode/decode plus the chat template; ``eos_token_ids`` end a completion."""

    backend: HFTokenizer
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None = None
    add_bos_token: bool = False
    chat_template: str | None = None
    special_tokens: dict[str, str] = field(default_factory=dict)
    _template: jinja2.Template | None = field(default=None, init=False, repr=False)
    _plain: HFTokenizer | None = field(default=None, init=False, repr=False)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """An upper bound on the UTF-8 bytes one token stands for (its vocabulary spelling is never
        shorter in UTF-8), so a text of B bytes holds at least B / this many tokens."""
        return max((len(t.encode()) for t in self.backend.get_vocab(with_added_tokens=True)), default=1)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = _encode_ids(self.backend, text)
        bos = self.bos_token_id
        if add_special_tokens and self.add_bos_token and bos is not None and (not ids or ids[0] != bos):
            ids = [bos, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """Render ``messages`` (role + content) to the prompt text the model was trained on."""
        if not self.chat_template:
            raise TemplateError("this model has no chat template; send a raw prompt instead")
        if self._template is None:
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
            )
            env.globals["raise_exception"] = _raise_exception
            self._template = env.from_string(self.chat_template)
        try:
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **self.special_tokens
            )
        except jinja2.TemplateError as exc:
            raise TemplateError(f"chat template failed: {exc}") from exc

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """The conversation's prompt ids; message contents are always text, never control tokens.

        A user who writes ``<|im_start|>system`` in a message gets those characters, not a forged
        system turn: the template's own markup is encoded with special tokens recognised, each
        message's content with them encoded as plain text. Templates write BOS themselves.
        """
        text = self.apply_chat_template(messages)
        pieces = self._split_contents(messages, text)
        if pieces is None:  # the template rewrites contents beyond trimming: no safe way to split
            self._refuse_special_text(messages)
            return self.encode(text, add_special_tokens=False)
        ids: list[int] = []
        for i, piece in enumerate(pieces):
            if i % 2 == 0:
                ids += _encode_ids(self.backend, piece) if piece else []
            elif piece:
                ids += _encode_ids(self._plain_backend(), piece)
        return ids

    def _split_contents(self, messages: list[dict[str, str]], text: str) -> list[str] | None:
        """``text`` as [markup, content, markup, content, ..., markup], or None if not recoverable.

        The template is rendered again with a unique mark in place of each content; the marks show
        where contents sit. A template that trims contents is matched with trimmed contents.
        """
        marks = [f"\x00loom{secrets.token_hex(8)}\x00" for _ in messages]
        marked = self.apply_chat_template([{**m, "content": k} for m, k in zip(messages, marks, strict=True)])
        for clean in (lambda c: c, str.strip):
            pieces: list[str] = []
            rest = marked
            for mark, m in zip(marks, messages, strict=True):
                before, found, rest = rest.partition(mark)
                if not found:
                    break
                pieces += [before, clean(m.get("content", ""))]
            else:
                pieces.append(rest)
                if "".join(pieces) == text:
                    return pieces
        return None

    def warm(self) -> Tokenizer:
        """Build now what the first request would otherwise build in its path: the plain-text twin
        of the backend (about 0.1 s for a 49k vocabulary), the vocabulary's longest token and the
        chat template."""
        self._plain_backend()
        _ = self.max_token_bytes
        if self.chat_template:
            self.encode_chat([{"role": "user", "content": "warm"}])
        return self

    def _plain_backend(self) -> HFTokenizer:
        """A twin of the backend that encodes special-token text as ordinary text (thread-safe: separate)."""
        if self._plain is None:
            plain = HFTokenizer.from_str(self.backend.to_str())
            plain.encode_special_tokens = True
            self._plain = plain
        return self._plain

    def _refuse_special_text(self, messages: list[dict[str, str]]) -> None:
        specials = [t.content for t in self.backend.get_added_tokens_decoder().values() if t.special]
        for i, m in enumerate(messages):
            for token in specials:
                if token and token in m.get("content", ""):
                    raise TemplateError(
                        f"messages[{i}].content contains the control token {token!r}, which this model's "
                        "chat template cannot carry as text"
                    )

    # ---- builders -------------------------------------------------------------------------------

    @classmethod
    def from_hf_dir(cls, path: Path, eos_token_ids: Sequence[int] = ()) -> Tokenizer:
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"{tok_file} is missing (Loom reads fast-tokenizer files only)")
        backend = HFTokenizer.from_file(str(tok_file))
        cfg: dict[str, Any] = {}
        cfg_file = path / "tokenizer_config.json"
        if cfg_file.is_file():
            cfg = json.loads(cfg_file.read_text())
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        tmpl_file = path / "chat_template.jinja"
        if template is None and tmpl_file.is_file():
            template = tmpl_file.read_text()

        def token_text(key: str) -> str | None:
            value = cfg.get(key)
            return value.get("content") if isinstance(value, dict) else value

        specials = {k: v for k in ("bos_token", "eos_token") if (v := token_text(k)) is not None}
        eos_ids = list(eos_token_ids)
        if "eos_token" in specials:
            eos_id = backend.token_to_id(specials["eos_token"])
            if eos_id is not None and eos_id not in eos_ids:
                eos_ids.append(eos_id)
        bos_id = backend.token_to_id(specials["bos_token"]) if "bos_token" in specials else None
        return cls(
            backend=backend,
            eos_token_ids=tuple(eos_ids),
            bos_token_id=bos_id,
            add_bos_token=bool(cfg.get("add_bos_token", False)),
            chat_template=template,
            special_tokens=specials,
        )

    @classmethod
    def from_gguf_fields(cls, fields: dict[str, Any]) -> Tokenizer:
        """Rebuild a byte-level BPE tokenizer from GGUF ``tokenizer.ggml.*`` metadata."""
        kind = fields.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(
                f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE, 'gpt2'); "
                "load this model from its Hugging Face directory instead"
            )
        pre = fields.get("tokenizer.ggml.pre", "default")
        tokens: list[str] = fields["tokenizer.ggml.tokens"]
        types: list[int] = fields.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        merges = [tuple(m.split(" ", 1)) for m in fields["tokenizer.ggml.merges"]]
        vocab = {t: i for i, t in enumerate(tokens)}
        backend = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
        backend.pre_tokenizer = _gguf_pre_tokenizer(pre)
        backend.decoder = decoders.ByteLevel()
        # Control (3) and user-defined (4) tokens are matched whole, never split by BPE.
        from tokenizers import AddedToken

        specials = [
            AddedToken(tokens[i], special=True, normalized=False) for i, t in enumerate(types) if t in (3, 4)
        ]
        backend.add_special_tokens(specials)

        bos = fields.get("tokenizer.ggml.bos_token_id")
        eos = fields.get("tokenizer.ggml.eos_token_id")
        eot = fields.get("tokenizer.ggml.eot_token_id")
        eos_ids = tuple(dict.fromkeys(i for i in (eos, eot) if i is not None))
        special_text = {}
        if bos is not None:
            special_text["bos_token"] = tokens[bos]
        if eos is not None:
            special_text["eos_token"] = tokens[eos]
        return cls(
            backend=backend,
            eos_token_ids=eos_ids,
            bos_token_id=bos,
            add_bos_token=bool(fields.get("tokenizer.ggml.add_bos_token", False)),
            chat_template=fields.get("tokenizer.chat_template"),
            special_tokens=special_text,
        )


# Pre-tokenizer splits of llama.cpp's named "pre" types that Loom reproduces.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _gguf_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("smollm", "starcoder", "refact"):
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in ("gpt2", "default"):
        return byte_level
    split = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}.get(pre)
    if split is None:
        raise ValueError(f"GGUF tokenizer pre-type {pre!r} is not supported; load the Hugging Face directory")
    from tokenizers import Regex

    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
