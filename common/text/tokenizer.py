"""Tokenizer: an HF fast tokenizer (tokenizer.json) plus the model dir's chat template and EOS.

Reads only local files of an HF model directory:

- ``tokenizer.json`` (required): the ``tokenizers`` pipeline (normalizer, pre-tokenizer, model,
  post-processor, decoder, added tokens).
- ``tokenizer_config.json``: special token strings and ``chat_template`` (a string, or a list of
  ``{name, template}`` of which "default" is used); a ``chat_template.jinja`` file next to it
  takes precedence, as in transformers.
- ``generation_config.json`` / ``config.json``: ``eos_token_id`` (int or list).

Chat templates render as transformers renders them: a jinja2 ``ImmutableSandboxedEnvironment``
with ``trim_blocks``/``lstrip_blocks``, the ``loopcontrols`` extension, ``raise_exception``,
``strftime_now``, a non-escaping ``tojson``, and ``messages``, ``add_generation_prompt``,
``tools``/``documents`` (None) and the special token strings (``bos_token``, ``eos_token``, ...)
in the context.  Decoding does not apply transformers' ``clean_up_tokenization_spaces``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from common.wire.byte_level import byte_of_char

_TOKEN_BYTES_CACHE = 1 << 18  # token_bytes() results kept (a vocabulary or two)
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


class ChatTemplateError(ValueError):
    """The chat template rejected the messages (``raise_exception``) or failed to render."""


class Tokenizer:
    """Encode/decode text and render chat prompts for one model.

    Nothing here mutates the underlying ``tokenizers.Tokenizer`` after construction, so one
    instance can serve many sequences (and threads) at once.
    """

    def __init__(
        self,
        backend: HFTokenizer,
        *,
        eos_token_ids: Sequence[int] = (),
        special_tokens: Mapping[str, str] | None = None,
        chat_template: str | None = None,
        bos_token_id: int | None = None,
    ) -> None:
        self._backend = backend
        self._special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        self._eos_token_ids = list(dict.fromkeys(int(i) for i in eos_token_ids))
        self._chat_template = chat_template
        bos = self._special_tokens.get("bos_token")
        self._bos_token_id = backend.token_to_id(bos) if bos is not None else bos_token_id
        self._token_bytes: dict[int, bytes] = {}  # token_bytes(), filled as asked (idempotent)

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load from a local HF model directory (see the module docstring for the files read).

        Raises FileNotFoundError naming the directory or ``tokenizer.json`` when missing, and
        ValueError naming the file when a JSON file is malformed.
        """
        root = Path(path)
        if not root.is_dir():
            raise FileNotFoundError(f"model directory not found: {root}")
        tokenizer_file = root / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(
                f"{tokenizer_file} not found: pdserve needs an HF fast tokenizer (tokenizer.json)"
            )
        try:
            backend = HFTokenizer.from_file(str(tokenizer_file))
        except Exception as e:  # tokenizers raises a bare Exception on parse errors
            raise ValueError(f"cannot load {tokenizer_file}: {e}") from e
        tok_cfg = _read_json(root / "tokenizer_config.json")
        gen_cfg = _read_json(root / "generation_config.json")
        model_cfg = _read_json(root / "config.json")
        special = {k: _token_content(tok_cfg.get(k)) for k in _SPECIAL_TOKEN_KEYS}
        special_str = {k: v for k, v in special.items() if v is not None}
        eos = _first_id_list(gen_cfg.get("eos_token_id"), model_cfg.get("eos_token_id"))
        if eos is None:
            eos_id = backend.token_to_id(special["eos_token"]) if special["eos_token"] else None
            eos = [eos_id] if eos_id is not None else []
        bos_fallback = gen_cfg.get("bos_token_id", model_cfg.get("bos_token_id"))
        return cls(
            backend,
            eos_token_ids=eos,
            special_tokens=special_str,
            chat_template=_load_chat_template(root, tok_cfg),
            bos_token_id=bos_fallback if isinstance(bos_fallback, int) else None,
        )

    # -- encode / decode ----------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` runs the post-processor (e.g. BOS).

        Added/special tokens written literally in ``text`` (e.g. "<|im_start|>") are matched as
        such, as in HF.
        """
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; ids unknown to the tokenizer are ignored.  Invalid UTF-8 -> U+FFFD."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary string of ``token_id`` (byte-level / sentencepiece form), or None."""
        return self._backend.id_to_token(token_id)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str | None]:
        return [self._backend.id_to_token(i) for i in ids]

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes `token_id` stands for in decoded text (a byte-level token may be part of
        a UTF-8 character); added tokens are their text. Unknown ids: b""."""
        if token_id in self._token_bytes:
            return self._token_bytes[token_id]
        piece = self._backend.id_to_token(token_id)
        if piece is None:
            out = b""
        elif token_id in self._added_ids:
            out = piece.encode()
        elif self._byte_level:
            table = byte_of_char()
            out = bytes(table[c] for c in piece if c in table)
        elif token_id in self.byte_fallback_ids:
            out = bytes([int(piece[3:5], 16)])
        else:  # sentencepiece: the metaspace stands for a space
            out = piece.replace("\u2581", " ").encode()
        if len(self._token_bytes) < _TOKEN_BYTES_CACHE:
            self._token_bytes[token_id] = out
        return out

    # -- chat ---------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """Render ``messages`` (dicts with "role" and "content") into the prompt text;
        ``tools`` (OpenAI tool definitions) go to the template as transformers passes them.

        Keys whose value is None are dropped first, as transformers does.  Raises
        ChatTemplateError when the model has no template or the template rejects the input.
        """
        template = self._compiled_chat_template
        plain = [{k: v for k, v in dict(m).items() if v is not None} for m in messages]
        try:
            return template.render(
                messages=plain,
                add_generation_prompt=add_generation_prompt,
                tools=list(tools) if tools is not None else None,
                documents=None,
                **self._special_tokens,
            )
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError) as e:
            # Templates index and concatenate message fields; malformed messages fail there.
            raise ChatTemplateError(f"chat template failed: {e}") from e

    def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
    ) -> list[int]:
        """Token ids of the rendered chat prompt.

        The rendered text is encoded with ``add_special_tokens=False``: chat templates write
        the BOS (and any other special tokens) themselves, so letting the post-processor add
        one would double it.  This is what HF ``apply_chat_template(tokenize=True)`` and vLLM's
        chat endpoint do.
        """
        prompt = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        return self.encode(prompt, add_special_tokens=False)

    @cached_property
    def _compiled_chat_template(self) -> jinja2.Template:
        if self._chat_template is None:
            raise ChatTemplateError("this model has no chat template (tokenizer_config.json)")
        try:
            return _chat_environment().from_string(self._chat_template)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template does not compile: {e}") from e

    # -- properties ---------------------------------------------------------------------------

    @property
    def backend(self) -> HFTokenizer:
        """The underlying ``tokenizers.Tokenizer`` (do not mutate it)."""
        return self._backend

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    @property
    def eos_token_ids(self) -> list[int]:
        """Ids that end generation (generation_config, else config, else the eos_token)."""
        return list(self._eos_token_ids)

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def bos_token(self) -> str | None:
        return self._special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self._special_tokens.get("eos_token")

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer knows, added tokens included.  The model's embedding may
        be larger (padded); ids beyond the tokenizer's decode to nothing."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @cached_property
    def _added_ids(self) -> frozenset[int]:
        return frozenset(self._backend.get_added_tokens_decoder())

    @cached_property
    def _byte_level(self) -> bool:
        decoder = self._backend.decoder
        return decoder is not None and b'"ByteLevel"' in decoder.__getstate__()

    @cached_property
    def special_token_ids(self) -> frozenset[int]:
        """Ids of added tokens marked special (those ``skip_special_tokens`` drops)."""
        decoder = self._backend.get_added_tokens_decoder()
        return frozenset(i for i, tok in decoder.items() if tok.special)

    @cached_property
    def byte_fallback_ids(self) -> frozenset[int]:
        """Ids of ``<0xNN>`` tokens when the decoder has a ByteFallback step, else empty.

        A run of such tokens decodes as a unit: if the run is not valid UTF-8 *as a whole*,
        every byte becomes U+FFFD, so a later byte token can change the text of earlier ones.
        The incremental detokenizer holds text back while a run is open.
        """
        decoder = self._backend.decoder
        if decoder is None or b'"ByteFallback"' not in decoder.__getstate__():
            return frozenset()
        ids = (self._backend.token_to_id(f"<0x{b:02X}>") for b in range(256))
        return frozenset(i for i in ids if i is not None)


def _chat_environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, _GenerationTag],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (HF's assistant-mask marker) renders its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _read_json(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``, or {} when the file does not exist."""
    if not path.is_file():
        return {}
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(obj, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return obj


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config stores it: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _first_id_list(*candidates: Any) -> list[int] | None:
    """The first candidate that is an int or a non-empty list of ints, as a list."""
    for value in candidates:
        if isinstance(value, int) and not isinstance(value, bool):
            return [value]
        if isinstance(value, list) and value and all(isinstance(v, int) for v in value):
            return list(value)
    return None


def _load_chat_template(root: Path, tok_cfg: Mapping[str, Any]) -> str | None:
    jinja_file = root / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    raw = tok_cfg.get("chat_template")
    if isinstance(raw, str):
        return raw
    if isinstance(raw, list):
        named = {t.get("name"): t.get("template") for t in raw if isinstance(t, dict)}
        default = named.get("default")
        return default if isinstance(default, str) else None
    return None
