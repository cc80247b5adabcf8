"""CLIP BPE tokenizer producing exactly the token ids Meta's SAM 3 text encoder sees.

Meta (`sam3/model/tokenizer_ve.py` `SimpleTokenizer`, called by `text_encoder_ve.py`
`VETextEncoder` as `tokenizer(prompts, context_length=32)`) does, per prompt:

1. clean ("lower"): `ftfy.fix_text`, `html.unescape` twice, strip, collapse `\\s+` runs to one
   space, strip, `str.lower()`;
2. split with CLIP's regex (`<start_of_text>`, `<end_of_text>`, contractions, letter runs,
   single digits, other non-space runs), byte-encode each piece and apply CLIP BPE
   (`bpe_simple_vocab_16e6.txt.gz`, 49408 ids);
3. `[SOT] + ids + [EOT]`, cut to `context_length` with the last id forced to EOT, then right-pad
   with id 0.

Two backends, both exact (tests/test_text.py compares them with Meta on a fixed list and
~400 random unicode strings):

* `ClipTokenizer(bpe_path)`: open_clip's `SimpleTokenizer` (same code lineage as Meta's; its only
  difference, `str.split()` instead of `regex` `\\s+` in the whitespace step, disagrees on
  U+001C..U+001F alone, which `ftfy.fix_text` has already removed). Importing open_clip costs
  several seconds (it pulls in its model zoo).
* `ClipTokenizer.from_pretrained_dir(dir)`: a Hugging Face `tokenizer.json` run by `tokenizers`.
  Alone it does NOT reproduce Meta: its normaliser is NFC + `\\s+` -> " " + per-char lowercase,
  so it skips ftfy (curly quotes, ligatures, full-width forms, mojibake, C1/C0 controls such as
  U+0085 or U+001C), html entities (`&amp;`), the final-sigma rule of `str.lower()` ("ΟΔΟΣ"),
  treats `<|startoftext|>`/`<|endoftext|>` rather than Meta's `<start_of_text>`/`<end_of_text>`
  as special, and pads with its pad token (`<|endoftext|>` = 49407 by default; `transformers`'
  SAM 3 processor pads to 32 that way) instead of 0. So we run Meta's cleaning and Meta's split
  regex in Python first, encode the pieces with `add_special_tokens=False` and HF special-token
  matching off, and frame and pad ourselves.

Padding id 0 is also the id of "!" as a word-internal BPE piece (e.g. "hello!~"); the text
encoder's padding mask (`ids == 0`) inherits that from Meta on purpose.
"""

from __future__ import annotations

import html
import importlib.util
import os
from collections.abc import Callable, Sequence

import torch

PAD_ID = 0  # Meta zero-fills after EOT; the text encoder's padding mask is `ids == PAD_ID`
_META_SPECIALS = ("<start_of_text>", "<end_of_text>")  # names in Meta's / open_clip's vocab
_HF_SPECIALS = ("<|startoftext|>", "<|endoftext|>")  # names in HF's CLIP vocab.json, same ids
_CLIP_SPLIT = r"""|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"""  # after the specials


def default_bpe_path() -> str:
    """Path of CLIP's BPE vocabulary inside the installed `open_clip_torch` (found without
    importing open_clip)."""
    spec = importlib.util.find_spec("open_clip")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "CLIP BPE vocabulary not found: install open_clip_torch (it ships "
            "bpe_simple_vocab_16e6.txt.gz) or pass a checkpoint directory with tokenizer.json"
        )
    return os.path.join(list(spec.submodule_search_locations)[0], "bpe_simple_vocab_16e6.txt.gz")


def clean_lower(text: str) -> str:
    """Meta's `clean="lower"` text normalisation (`tokenizer_ve.py` `_clean_lower`)."""
    import ftfy
    import regex

    text = html.unescape(html.unescape(ftfy.fix_text(text))).strip()
    return regex.sub(r"\s+", " ", text).strip().lower()


class ClipTokenizer:
    """`__call__(prompts: list[str]) -> LongTensor [P, context_length]` on CPU:
    SOT, BPE ids, EOT, zeros; prompts longer than `context_length - 2` BPE ids are cut and end
    in EOT. A bare `str` counts as one prompt (as in Meta)."""

    def __init__(self, bpe_path: str | os.PathLike | None = None, context_length: int = 32):
        path = os.fspath(bpe_path) if bpe_path is not None else default_bpe_path()
        if not os.path.isfile(path):
            raise FileNotFoundError(f"CLIP BPE vocabulary {path!r} does not exist")
        from open_clip.tokenizer import SimpleTokenizer

        bpe = SimpleTokenizer(bpe_path=path, clean="lower")
        self._setup(bpe.encode, bpe.sot_token_id, bpe.eot_token_id, context_length)

    @classmethod
    def from_pretrained_dir(cls, path: str | os.PathLike, context_length: int = 32) -> "ClipTokenizer":
        """Tokenizer from a Hugging Face checkpoint directory holding `tokenizer.json`
        (e.g. a `facebook/sam3` snapshot), with Meta's cleaning, framing and zero padding."""
        file = os.path.join(os.fspath(path), "tokenizer.json")
        if not os.path.isfile(file):
            raise FileNotFoundError(f"no tokenizer.json in {os.fspath(path)!r}")
        try:
            from tokenizers import Tokenizer
        except ImportError as e:  # installed with transformers
            raise ImportError("loading tokenizer.json needs the `tokenizers` package") from e

        hf = Tokenizer.from_file(file)
        hf.no_padding()
        hf.no_truncation()
        hf.encode_special_tokens = True  # "<|endoftext|>" typed in a prompt is plain text to Meta
        sot, eot = (_token_id(hf, names, file) for names in zip(_META_SPECIALS, _HF_SPECIALS))

        import regex

        # Meta's own split (with its special literals) decides the pieces; HF's tokenizer then
        # byte-encodes and BPE-merges them. Running Meta's split first matters only for the
        # literals "<start_of_text>" / "<end_of_text>", which Meta turns into SOT / EOT unless a
        # punctuation run swallows their "<" (e.g. "!<end_of_text>").
        pieces = regex.compile("|".join(_META_SPECIALS) + _CLIP_SPLIT, regex.IGNORECASE)
        special_ids = dict(zip(_META_SPECIALS, (sot, eot)))

        def encode(text: str) -> list[int]:
            ids: list[int] = []
            run: list[str] = []  # pieces since the last special literal
            for piece in [*pieces.findall(clean_lower(text)), _META_SPECIALS[1]]:
                if piece in special_ids:
                    if run:  # pieces hold no spaces, so joining with " " re-splits them identically
                        ids.extend(hf.encode(" ".join(run), add_special_tokens=False).ids)
                        run = []
                    ids.append(special_ids[piece])
                else:
                    run.append(piece)
            return ids[:-1]  # drop the sentinel EOT that flushed the last run

        tok = cls.__new__(cls)
        tok._setup(encode, sot, eot, context_length)
        return tok

    def _setup(self, encode: Callable[[str], list[int]], sot_id: int, eot_id: int, context_length: int):
        if context_length < 2:
            raise ValueError("context_length must hold at least SOT and EOT")
        self._encode = encode
        self.sot_id, self.eot_id = sot_id, eot_id
        self.context_length = context_length

    def __call__(self, prompts: str | Sequence[str]) -> torch.Tensor:
        if isinstance(prompts, str):
            prompts = [prompts]
        out = torch.full((len(prompts), self.context_length), PAD_ID, dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids = [self.sot_id, *self._encode(prompt), self.eot_id][: self.context_length]
            ids[-1] = self.eot_id  # a cut prompt still ends in EOT
            out[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        return out  # [P, context_length]


def _token_id(hf, names: Sequence[str], file: str) -> int:
    for name in names:
        idx = hf.token_to_id(name)
        if idx is not None:
            return idx
    raise ValueError(f"{file} has none of the special tokens {list(names)}")


def load_tokenizer(path: str | os.PathLike | None, context_length: int) -> ClipTokenizer:
    """None: open_clip's bundled CLIP vocabulary; a directory (or its `tokenizer.json`): that
    `tokenizer.json`; another file: a CLIP `bpe_simple_vocab_16e6.txt.gz`-format vocabulary."""
    if path is not None and os.path.basename(os.fspath(path)) == "tokenizer.json":
        path = os.path.dirname(os.fspath(path))
    if path is not None and os.path.isdir(path):
        return ClipTokenizer.from_pretrained_dir(path, context_length)
    return ClipTokenizer(path, context_length)
