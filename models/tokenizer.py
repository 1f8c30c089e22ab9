"""A byte-level BPE tokenizer built from a GGUF file's own vocabulary; no network, no transformers.

A GGUF carries no tokenizer.json, only llama.cpp's metadata:
  tokenizer.ggml.model       "gpt2" = byte-level BPE (the only kind supported here)
  tokenizer.ggml.pre         which pre-tokenizer split the merges were learned with
  tokenizer.ggml.tokens      id -> token, spelled in GPT-2's byte-to-unicode alphabet ("Ġ" = space)
  tokenizer.ggml.merges      "a b" strings, best first
  tokenizer.ggml.token_type  1 normal, 3 control (special), 4 user defined, 5 unused
  tokenizer.ggml.{bos,eos}_token_id, tokenizer.ggml.add_bos_token
  tokenizer.ggml.{eot,eom}_token_id   end of turn / end of message, where the file has them
  tokenizer.chat_template    the Jinja chat template, where the file has one
From these we rebuild what the model's original tokenizer.json did (the same choices as
transformers' GGUF converter and llama.cpp's `llama-vocab.cpp` pre-tokenizer table).
"""

from __future__ import annotations

import functools
import json
import mmap
import os
import pathlib
import re
import struct
import threading
from collections.abc import Iterable

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from models import chat_template
from models.families import FAMILIES
from models.gguf_loader import PathOrReader, metadata_value, open_gguf
from models.too_long import TooLong

_FORMAT = "spec_jax.tokenizer/1"

# Qwen2's split (its tokenizer.json; llama.cpp LLAMA_VOCAB_PRE_TYPE_QWEN2): case-insensitive
# contractions, every digit alone, a word may take one leading non-letter (" word", "_word").
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Llama 3's split: like Qwen2's but digits in groups of up to three.
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {
    "qwen2": QWEN2_SPLIT,
    "deepseek-r1-qwen": QWEN2_SPLIT,
    "llama3": LLAMA3_SPLIT,
    "llama-v3": LLAMA3_SPLIT,
    "llama-bpe": LLAMA3_SPLIT,
    "smaug-bpe": LLAMA3_SPLIT,
}
# GPT-2's own regex, applied by ByteLevel(use_regex=True); "smollm" first splits every digit
# off on its own (SmolLM2's tokenizer.json: Digits(individual_digits) + ByteLevel; llama.cpp's
# LLAMA_VOCAB_PRE_TYPE_SMOLLM: "\p{N}" then the GPT-2 regex).
_GPT2_LIKE = ("gpt2", "default", "smollm")
SUPPORTED_PRE = tuple(_SPLITS) + _GPT2_LIKE

_CONTROL, _USER_DEFINED = 3, 4

# Tokens that end a generation wherever a vocabulary has them (llama.cpp's `special_eog_ids`
# in llama-vocab.cpp: it stops at every one of these, besides eos / eot / eom). Qwen2.5 ends a
# document with <|endoftext|> and a chat turn with <|im_end|>; Llama 3 with <|end_of_text|>
# and <|eot_id|>; Gemma a turn with <end_of_turn>.
END_OF_GENERATION_TOKENS = (
    "<|endoftext|>",
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end_of_text|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<end_of_turn>",
    "<end_of_utterance>",
    "<EOT>",
    "_<EOT>",
)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character map (the byte-level alphabet)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(printable, map(chr, chars), strict=True))


def pre_tokenizer_for(pre: str):
    """The `tokenizers` pre-tokenizer for a `tokenizer.ggml.pre` value."""
    if pre in _SPLITS:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
            ]
        )
    if pre == "smollm":
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
            ]
        )
    if pre in _GPT2_LIKE:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    raise ValueError(f"unsupported tokenizer.ggml.pre {pre!r}; supported: {', '.join(SUPPORTED_PRE)}")


def build_tokenizer(
    tokens: list[str],
    merges: list[str],
    token_types: list[int] | None,
    pre: str,
    bos_id: int | None = None,
    add_bos: bool = False,
) -> HFTokenizer:
    """A `tokenizers.Tokenizer` from GGUF vocabulary metadata (see the module docstring)."""
    byte_map = bytes_to_unicode()
    alphabet = set(byte_map.values())
    vocab = {}
    for i, tok in enumerate(tokens):
        # Some converters store a token as raw text; BPE looks tokens up in the byte alphabet.
        key = tok if set(tok) <= alphabet else "".join(byte_map[b] for b in tok.encode("utf-8"))
        if key in vocab:
            raise ValueError(f"duplicate token {tok!r} at ids {vocab[key]} and {i}")
        vocab[key] = i
    pairs = []
    for m in merges:
        a, sep, b = m.partition(" ")
        if not sep or " " in b:
            raise ValueError(f"malformed merge {m!r}")
        pairs.append((a, b))
    tok = HFTokenizer(
        models.BPE(
            vocab=vocab,
            merges=pairs,
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
            ignore_merges=False,
        )
    )
    tok.pre_tokenizer = pre_tokenizer_for(pre)
    tok.decoder = decoders.ByteLevel()
    types = token_types or [1] * len(tokens)
    # Control tokens (<|im_start|>, <|endoftext|>) and user-defined ones (<tool_call>) are matched
    # whole in the text, as llama.cpp does; they must keep their vocabulary id, so only tokens that
    # are spelled in the byte alphabet (i.e. present in `vocab` under their own name) qualify.
    tok.add_special_tokens(_added_tokens(tokens, types, _CONTROL, vocab))
    tok.add_tokens(_added_tokens(tokens, types, _USER_DEFINED, vocab))
    return _with_bos(tok, tokens, bos_id, add_bos, exact_size=True)


def _added_tokens(tokens: list[str], types: list[int], kind: int, vocab=None) -> list[AddedToken]:
    """The tokens of GGUF token type `kind` (_CONTROL: special, _USER_DEFINED: plain), as
    AddedTokens matched whole in the text; with `vocab`, only those it spells (their ids kept)."""
    return [
        AddedToken(t, normalized=False, special=kind == _CONTROL)
        for t, k in zip(tokens, types, strict=True)
        if k == kind and (vocab is None or t in vocab)
    ]


def _with_bos(tok: HFTokenizer, tokens: list[str], bos_id, add_bos: bool, exact_size: bool) -> HFTokenizer:
    """`tok` with the BOS token prepended when add_bos (ValueError if the file names no
    bos_token_id); ValueError if it has more ids than the file lists (exact_size: other than)."""
    if add_bos:
        if bos_id is None:
            raise ValueError("add_bos_token is set but the file has no bos_token_id")
        bos = tokens[bos_id]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    size = tok.get_vocab_size(with_added_tokens=True)
    if size > len(tokens) or (exact_size and size != len(tokens)):
        raise ValueError(f"tokenizer has {size} ids, the file lists {len(tokens)}")
    return tok


NO_CHAT_TEMPLATE = (
    "the model has no chat template (no tokenizer.chat_template in its GGUF, no chat_template in "
    "its folder's chat_template.jinja or tokenizer_config.json)"
)


def read_chat_template(folder: str | os.PathLike) -> str | None:
    """The chat template of a Hugging Face checkpoint folder, as transformers picks it: the text
    of `chat_template.jinja` if the folder has one, else `tokenizer_config.json`'s
    "chat_template", which is a string or a list of {"name", "template"} entries (the one named
    "default" is taken); None where there is none. ValueError on a malformed entry."""
    folder = pathlib.Path(folder)
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    config = folder / "tokenizer_config.json"
    if not config.is_file():
        return None
    template = json.loads(config.read_text(encoding="utf-8")).get("chat_template")
    if template is None or isinstance(template, str):
        return template
    if isinstance(template, list) and all(
        isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)
        for t in template
    ):
        named = {t["name"]: t["template"] for t in template}
        if "default" not in named:
            raise ValueError(
                f"{config}: chat_template lists templates {sorted(named)} but none named 'default'"
            )
        return named["default"]
    raise ValueError(f"{config}: chat_template must be a string or a list of {{name, template}} entries")


# GGUF metadata value types (gguf.GGUFValueType) -> byte size, for the scalar ones.
_GGUF_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def gguf_chat_template(path: str | os.PathLike) -> str | None:
    """`tokenizer.chat_template` of a GGUF file, read by walking its metadata header only (a
    fraction of a second; gguf.GGUFReader parses every field, ~9 s for a Qwen vocabulary).
    For converted caches written before the template was stored with the tokenizer."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        magic, version, _, kv_count = struct.unpack_from("<4sIQQ", m, 0)
        if magic != b"GGUF" or version < 2:
            raise ValueError(f"{path}: not a GGUF file of version 2 or later")
        pos = 24

        def string(at):
            (n,) = struct.unpack_from("<Q", m, at)
            return m[at + 8 : at + 8 + n], at + 8 + n

        def skip(kind, at):
            if kind == _GGUF_STRING:
                return at + 8 + struct.unpack_from("<Q", m, at)[0]
            if kind == _GGUF_ARRAY:
                item, count = struct.unpack_from("<IQ", m, at)
                at += 12
                if item in _GGUF_SCALAR_BYTES:
                    return at + count * _GGUF_SCALAR_BYTES[item]
                for _ in range(count):
                    at = skip(item, at)
                return at
            return at + _GGUF_SCALAR_BYTES[kind]

        for _ in range(kv_count):
            key, pos = string(pos)
            (kind,) = struct.unpack_from("<I", m, pos)
            pos += 4
            if key == b"tokenizer.chat_template" and kind == _GGUF_STRING:
                return string(pos)[0].decode("utf-8")
            pos = skip(kind, pos)
    return None


def validate_messages(messages) -> list[dict[str, str]]:
    """`messages` as a list of {"role": str, "content": str} dicts (copies), or ValueError in one
    line naming the first bad entry."""
    if not isinstance(messages, list | tuple) or not messages:
        raise ValueError(
            f'messages must be a non-empty list of {{"role", "content"}} objects, got {messages!r:.80}'
        )
    for i, m in enumerate(messages):
        if (
            not isinstance(m, dict)
            or set(m) != {"role", "content"}
            or not isinstance(m["role"], str)
            or not isinstance(m["content"], str)
        ):
            raise ValueError(
                f'messages[{i}] must be {{"role": string, "content": string}} and nothing else, got {m!r:.80}'
            )
    return [dict(m) for m in messages]


def render_chat_template(
    template: str,
    messages,
    *,
    add_generation_prompt: bool = True,
    bos_token: str | None = None,
    eos_token: str | None = None,
) -> str:
    """`template` rendered for `messages` (validate_messages) the way transformers'
    apply_chat_template(..., tokenize=False) renders it: variables messages,
    add_generation_prompt, tools=None, documents=None, and bos_token / eos_token where the
    tokenizer has them (left undefined otherwise, as transformers leaves them). ValueError
    with the template's own message where it refuses the conversation (raise_exception)."""
    messages = validate_messages(messages)
    special = {k: v for k, v in (("bos_token", bos_token), ("eos_token", eos_token)) if v is not None}
    return chat_template.render(
        template,
        messages=messages,
        tools=None,
        documents=None,
        add_generation_prompt=add_generation_prompt,
        **special,
    )


# Characters of Unicode's Private Use Area that stand in for special-token text inside a chat
# message while the template is rendered (Tokenizer.encode_chat).
_STAND_INS = range(0xE000, 0xF900)


class Tokenizer:
    """Text <-> token ids for a GGUF model.

    `encode` adds BOS only when the file says `tokenizer.ggml.add_bos_token` (both Qwen2.5-Coder
    and SmolLM2 say no). Special-token text such as "<|im_start|>" in the input maps to its id
    (but not inside a chat message: encode_chat). `chat_template` is the model's Jinja chat
    template (None where it has none): see apply_chat_template and encode_chat. Thread-safe:
    tokenizing releases the GIL, so other Python threads run meanwhile.
    """

    def __init__(
        self,
        tokenizer: HFTokenizer,
        *,
        bos_id: int | None,
        eos_id: int | None,
        add_bos: bool = False,
        pre: str = "",
        vocab_size: int | None = None,
        stop_ids: Iterable[int] | None = None,
        chat_template: str | None = None,
    ):
        self._tok = tokenizer
        self.chat_template = chat_template
        self._bos_id = bos_id
        self._eos_id = eos_id
        self.add_bos = add_bos
        self.pre = pre
        self._vocab_size = vocab_size or tokenizer.get_vocab_size(with_added_tokens=True)
        if stop_ids is None:
            stop_ids = [eos_id] if eos_id is not None else []
            stop_ids += [i for t in END_OF_GENERATION_TOKENS if (i := tokenizer.token_to_id(t)) is not None]
        self._stop_ids = tuple(sorted(set(int(i) for i in stop_ids)))

    @classmethod
    def from_gguf(cls, path_or_reader: PathOrReader) -> Tokenizer:
        """Build from the GGUF metadata (no network). Accepts a path or an open GGUFReader."""
        reader = open_gguf(path_or_reader)
        model = metadata_value(reader, "tokenizer.ggml.model")
        if model not in ("gpt2", "llama"):
            raise ValueError(
                f"only byte-level BPE (tokenizer.ggml.model 'gpt2') and SentencePiece-style "
                f"vocabularies ('llama', for {', '.join(SENTENCEPIECE_ARCHS)}) are supported, got {model!r}"
            )
        tokens = metadata_value(reader, "tokenizer.ggml.tokens")
        merges = metadata_value(reader, "tokenizer.ggml.merges")
        if not tokens or (merges is None and model == "gpt2"):
            raise ValueError("GGUF file has no tokenizer.ggml.tokens / tokenizer.ggml.merges")
        pre = metadata_value(reader, "tokenizer.ggml.pre", "default")
        bos_id = metadata_value(reader, "tokenizer.ggml.bos_token_id")
        eos_id = metadata_value(reader, "tokenizer.ggml.eos_token_id")
        # llama.cpp adds BOS to a SentencePiece vocabulary whose file does not say otherwise.
        add_bos = bool(metadata_value(reader, "tokenizer.ggml.add_bos_token", model == "llama"))
        if model == "llama":
            tok = sentencepiece_from_gguf(reader, tokens, bos_id, add_bos)
        else:
            tok = build_tokenizer(
                tokens, merges, metadata_value(reader, "tokenizer.ggml.token_type"), pre, bos_id, add_bos
            )
        # The end-of-generation set: eos, eot and eom as the file names them, and every token of
        # END_OF_GENERATION_TOKENS the vocabulary has.
        marked = [metadata_value(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
        stop_ids = [i for i in marked if i is not None]
        stop_ids += [i for i, t in enumerate(tokens) if t in END_OF_GENERATION_TOKENS]
        return cls(
            tok,
            bos_id=bos_id,
            eos_id=eos_id,
            add_bos=add_bos,
            pre=pre,
            vocab_size=len(tokens),
            stop_ids=stop_ids,
            chat_template=metadata_value(reader, "tokenizer.chat_template"),
        )

    def encode(self, text: str, at_most: int | None = None, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text` (BOS prepended only if the model's metadata asks for it, and
        add_special_tokens). at_most: TooLong, before tokenizing, where min_tokens proves the
        text longer than that."""
        self._check_length(text, at_most, add_special_tokens=add_special_tokens)
        return _encode(self._tok, [text], add_special_tokens=add_special_tokens)[0]

    def min_tokens(self, text: str, add_special_tokens: bool = True) -> int:
        """A lower bound on the token count of `text` found without tokenizing it (0 where none
        is known). A byte-level BPE with no normalizer and all 256 bytes in its vocabulary turns
        each UTF-8 byte of the text into part of exactly one token, and no token covers more
        than the longest one's bytes (L, added tokens included): n bytes are at least
        ceil(n / L) tokens, plus the BOS encode adds (add_special_tokens)."""
        longest = self._longest_token_bytes
        if longest is None:
            return 0
        size = len(text.encode("utf-8", "surrogatepass"))
        return -(-size // longest) + int(add_special_tokens and self.add_bos)

    @functools.cached_property
    def _longest_token_bytes(self) -> int | None:
        """L of min_tokens, or None where the tokenizer is not a byte-level BPE over the raw
        text (a normalizer, a SentencePiece-style vocabulary, a byte missing)."""
        tok = self._tok
        if tok.normalizer is not None or not isinstance(tok.model, models.BPE):
            return None
        pre = tok.pre_tokenizer
        if pre is None or '"ByteLevel"' not in pre.__getstate__().decode("utf-8", "replace"):
            return None
        added = {t.content for t in tok.get_added_tokens_decoder().values()}
        alphabet = set(bytes_to_unicode().values())
        vocab = tok.get_vocab(with_added_tokens=False)
        if not all(c in vocab for c in alphabet):  # a byte no token spells could be dropped
            return None
        longest = 1
        for token in vocab:
            if token in added:
                continue
            if not set(token) <= alphabet:  # not spelled in bytes: no bound from its length
                return None
            longest = max(longest, len(token))
        return max([longest, *(len(t.encode("utf-8")) for t in added)])

    def _check_length(self, text: str, at_most: int | None, add_special_tokens: bool) -> None:
        if at_most is not None and (n := self.min_tokens(text, add_special_tokens)) > at_most:
            raise TooLong(n, at_most, len(text.encode("utf-8", "surrogatepass")), self._longest_token_bytes)

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> str:
        """The text of `messages` (a list of {"role": str, "content": str}) in the model's chat
        template, rendered as transformers' apply_chat_template(tokenize=False) renders it
        (render_chat_template; bos_token / eos_token are the tokens of bos_id / eos_id), with
        the assistant's turn opened when add_generation_prompt. ValueError on bad messages, or
        when the model has no template."""
        if self.chat_template is None:
            raise ValueError(NO_CHAT_TEMPLATE)
        token = lambda i: None if i is None else self.id_to_token(i)  # noqa: E731
        return render_chat_template(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=token(self._bos_id),
            eos_token=token(self._eos_id),
        )

    def encode_chat(
        self, messages, add_generation_prompt: bool = True, at_most: int | None = None
    ) -> list[int]:
        """Token ids of apply_chat_template(messages, add_generation_prompt), with no BOS added
        (the template writes the BOS where the model wants one, as transformers' tokenize=True
        encodes with add_special_tokens=False). Special tokens come from the template alone:
        special-token text inside a message ("<|im_end|>" typed by a user) is tokenized as
        plain text, so that no message can forge a turn boundary (transformers' would map it
        to the control token). at_most: TooLong, before tokenizing, as encode's.

        How: each special-token text in the messages is swapped for a Private Use Area
        character that appears nowhere else, the template is rendered, the text is cut at the
        special tokens it holds (the template's, all of them now), the pieces between get their
        text back and are tokenized with special tokens read as text. A conversation with no
        special-token text takes the plain path (render, tokenize) and the same ids."""
        messages = validate_messages(messages)
        pattern = self._special_pattern
        spelled = sorted({t for m in messages for t in pattern.findall(m["content"])}) if pattern else []
        if not spelled:
            text = self.apply_chat_template(messages, add_generation_prompt)
            self._check_length(text, at_most, add_special_tokens=False)
            return _encode(self._tok, [text], add_special_tokens=False)[0]
        taken = set(self.chat_template or "").union(*(m["role"] + m["content"] for m in messages))
        marks = dict(zip(spelled, (chr(c) for c in _STAND_INS if chr(c) not in taken), strict=False))
        if len(marks) < len(spelled):
            raise ValueError("the messages use up the characters that stand in for special-token text")
        swap = re.compile("|".join(re.escape(t) for t in spelled))
        swapped = [dict(m, content=swap.sub(lambda hit: marks[hit.group()], m["content"])) for m in messages]
        text = self.apply_chat_template(swapped, add_generation_prompt)
        back = str.maketrans({mark: token for token, mark in marks.items()})
        self._check_length(text.translate(back), at_most, add_special_tokens=False)
        parts = pattern.split(text)  # [text, special, text, ...]: the specials are the template's
        pieces = [p.translate(back) for p in parts[0::2]]
        encoded = _encode(self._as_text, pieces, add_special_tokens=False)
        ids = list(encoded[0])
        for special, piece in zip(parts[1::2], encoded[1:], strict=True):
            ids += [self._tok.token_to_id(special), *piece]
        return ids

    @functools.cached_property
    def _special_pattern(self) -> re.Pattern | None:
        """The special tokens' texts (the tokenizer's added tokens marked special) as one
        pattern that finds the longest at the leftmost place, as the tokenizer matches them;
        None where there are none."""
        texts = sorted(
            {t.content for t in self._tok.get_added_tokens_decoder().values() if t.special},
            key=lambda t: (-len(t), t),
        )
        return re.compile("(" + "|".join(re.escape(t) for t in texts) + ")") if texts else None

    @property
    def _as_text(self) -> HFTokenizer:
        """A copy of the tokenizer that reads special-token text as plain text (built once, on
        first use: about a second for a 150k vocabulary)."""
        with _AS_TEXT_LOCK:
            if self.__dict__.get("_as_text_tok") is None:
                tok = HFTokenizer.from_str(self._tok.to_str())
                tok.encode_special_tokens = True
                self.__dict__["_as_text_tok"] = tok
            return self.__dict__["_as_text_tok"]

    def encode_batch(self, texts: Iterable[str]) -> list[list[int]]:
        """`encode` over many texts (parallel in Rust)."""
        return _encode(self._tok, list(texts), add_special_tokens=True)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids`; byte sequences that are not valid UTF-8 decode to U+FFFD."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str | None:
        return self._tok.id_to_token(int(i))

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    @property
    def bos_id(self) -> int | None:
        return self._bos_id

    @property
    def eos_id(self) -> int | None:
        return self._eos_id

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Every token id that ends a generation (eos, eot, and the family's end tokens, as
        llama.cpp stops at them), sorted; pass it as spec_jax.generate(..., eos_id=...)."""
        return self._stop_ids

    @property
    def vocab_size(self) -> int:
        """Number of ids (= embedding rows; includes control and unused placeholder tokens)."""
        return self._vocab_size

    @property
    def backend(self) -> HFTokenizer:
        """The underlying `tokenizers.Tokenizer`."""
        return self._tok

    def to_json(self) -> str:
        """Serialize (tokenizers' own JSON plus our bos/eos fields) for a cache."""
        return json.dumps(
            {
                "format": _FORMAT,
                "bos_id": self._bos_id,
                "eos_id": self._eos_id,
                "stop_ids": list(self._stop_ids),
                "add_bos": self.add_bos,
                "pre": self.pre,
                "vocab_size": self._vocab_size,
                "chat_template": self.chat_template,
                "tokenizer": json.loads(self._tok.to_str()),
            },
            ensure_ascii=False,
        )

    @classmethod
    def from_json(cls, text: str, gguf: str | os.PathLike | None = None) -> Tokenizer:
        """Inverse of `to_json`. A document written before the chat template was kept in it (no
        "chat_template" field) takes the template of `gguf`, the file it was built from, where
        that file is there."""
        data, tok = _parsed(text)
        return cls(
            tok,
            bos_id=data["bos_id"],
            eos_id=data["eos_id"],
            add_bos=data["add_bos"],
            pre=data["pre"],
            vocab_size=data["vocab_size"],
            stop_ids=data.get("stop_ids"),  # caches written before it existed: derived from the vocab
            chat_template=data["chat_template"]
            if "chat_template" in data
            else (gguf_chat_template(gguf) if gguf is not None and os.path.isfile(gguf) else None),
        )

    def save(self, path: str | os.PathLike) -> None:
        """Write `to_json()` to `path`."""
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike, gguf: str | os.PathLike | None = None) -> Tokenizer:
        """Read a file written by `save` (`gguf`: as from_json)."""
        with open(path, encoding="utf-8") as f:
            return cls.from_json(f.read(), gguf)

    def __repr__(self) -> str:
        return (
            f"Tokenizer(pre={self.pre!r}, vocab_size={self.vocab_size}, bos_id={self.bos_id}, "
            f"eos_id={self.eos_id}, stop_ids={list(self.stop_ids)}, add_bos={self.add_bos}, "
            f"chat_template={'yes' if self.chat_template is not None else 'none'})"
        )


_AS_TEXT_LOCK = threading.Lock()


def _encode(tok: HFTokenizer, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
    """The ids of each of texts. encode_batch, even for one text: tokenizers' encode holds the
    GIL while it works (a 20 MB prompt: 16 s in which no other Python thread runs), its
    encode_batch releases it."""
    return [e.ids for e in tok.encode_batch(texts, add_special_tokens=add_special_tokens)]


@functools.lru_cache(maxsize=4)
def _parsed(text: str) -> tuple[dict, HFTokenizer]:
    """(the fields of a Tokenizer.to_json document but its "tokenizer", the HF tokenizer built
    from that), parsed once per process per document: a Qwen tokenizer takes 0.8-1.3 s to parse
    (two JSON passes and from_str), and a process that loads one model again (a test module, a
    notebook) reads the same document.
    (The Qwen pair's two documents differ, so a draft's is parsed on its own.) The HF tokenizer
    is shared, never changed after it is built; each Tokenizer is a new object around it.
    ValueError for a document of another format."""
    data = json.loads(text)
    if data.get("format") != _FORMAT:
        raise ValueError(f"not a {_FORMAT} document (format={data.get('format')!r})")
    tokenizer = HFTokenizer.from_str(json.dumps(data.pop("tokenizer")))  # the vocabulary is not kept twice
    return data, tokenizer


# SentencePiece-style vocabularies (tokenizer.ggml.model "llama"): Gemma 3's GGUF. The file holds
# the pieces ("▁" for a space), scores and byte tokens "<0x41>", but no merges. Rebuilt as
# transformers' GGUF converter builds it (integrations/gguf/gguf_tokenizer_mapping.py,
# gemma_tokenizer, and models/gemma/tokenization_gemma.py): a BPE with byte fallback whose merges
# are derived from the vocabulary, best first in the order of the file (Gemma's scores do not
# follow its merge order), spaces written as "▁" by the normalizer and back by the decoder.
SENTENCEPIECE_ARCHS = tuple(
    a for f in FAMILIES.values() if f.gguf_vocab == "sentencepiece" for a in f.gguf_archs
)


def sentencepiece_merges(vocab: dict[str, int], rank: dict[str, float]) -> list[tuple[str, str]]:
    """The BPE merges a vocabulary implies (transformers' generate_merges with scores): every
    split of a token into two tokens, best `rank` (of the merged token) first, then the longer
    left piece, then the longer right piece; the splits of one token ordered by their pieces' ids."""
    merges = []
    for merged, score in rank.items():
        local = [
            (merged[:i], merged[i:], score)
            for i in range(1, len(merged))
            if merged[:i] in vocab and merged[i:] in vocab
        ]
        merges.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]


def sentencepiece_from_gguf(reader, tokens: list[str], bos_id: int | None, add_bos: bool) -> HFTokenizer:
    """A `tokenizers.Tokenizer` of a SentencePiece-style GGUF vocabulary (SENTENCEPIECE_ARCHS): see
    the comment above. Control tokens (type 3) are matched whole as special tokens, user-defined
    ones (type 4) whole as plain added tokens, as in build_tokenizer."""
    arch = metadata_value(reader, "general.architecture")
    if arch not in SENTENCEPIECE_ARCHS:
        raise ValueError(
            f"SentencePiece-style GGUF vocabularies are supported for {', '.join(SENTENCEPIECE_ARCHS)} "
            f"only, not {arch!r}"
        )
    # A token of two or more spaces is stored as spaces; the normalizer writes them as "▁".
    spelled = ["▁" * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {t: i for i, t in enumerate(spelled)}
    rank = {t: -i for i, t in enumerate(spelled)}  # the file's order is the merge order
    unk_id = metadata_value(reader, "tokenizer.ggml.unknown_token_id")
    tok = HFTokenizer(
        models.BPE(
            vocab=vocab,
            merges=sentencepiece_merges(vocab, rank),
            dropout=None,
            unk_token=tokens[unk_id] if unk_id is not None else "<unk>",
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous", invert=False)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    types = metadata_value(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    # Every control token is special here, whatever its spelling (unlike build_tokenizer),
    # and the file may list more ids than the model's vocabulary holds (exact_size=False).
    tok.add_special_tokens(_added_tokens(tokens, types, _CONTROL))
    tok.add_tokens(_added_tokens(tokens, types, _USER_DEFINED, vocab))
    return _with_bos(tok, tokens, bos_id, add_bos, exact_size=False)


@functools.lru_cache(maxsize=16)
def check_pair(target_tokenizer, draft_tokenizer, target_vocab: int, draft_vocab: int) -> None:
    """ValueError, in one line naming the first differing token id and both its strings, unless
    the draft's vocabulary (ids 0..draft_vocab-1, by `id_to_token`) is the target's or a prefix
    of it (Qwen2.5 1.5B has 151,936 ids and 7B 152,064, the same up to 151,936). The sizes are
    the models' (embedding rows, placeholders included), not the tokenizers' counts. A pair that
    passed is remembered (tokenizer objects by identity): the CLI checks before loading and each
    spec_jax.generate call checks again, and the walk over 151,936 ids takes about 0.2 s."""
    for i in range(draft_vocab):
        draft_token = draft_tokenizer.id_to_token(i)
        target_token = target_tokenizer.id_to_token(i) if i < target_vocab else None
        if i >= target_vocab or draft_token != target_token:
            where = f"{target_token!r}" if i < target_vocab else f"past its end ({target_vocab} ids)"
            raise ValueError(
                "the draft and the target do not share a tokenizer and vocabulary: token id "
                f"{i} is {where} in the target's and {draft_token!r} in the draft's (the draft's "
                "vocabulary must be the target's or a prefix of it)"
            )


# --- Hugging Face checkpoint folders (models.sources) ---------------------------------------


def _token_text(value) -> str | None:
    """A tokenizer_config.json special token: a string, or an AddedToken dict with "content"."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path) -> dict:
    """A JSON file as a dict, {} where the file is absent."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        return {}


def from_hf_folder(folder: str | os.PathLike) -> Tokenizer:
    """The Tokenizer of a Hugging Face checkpoint folder: `tokenizer.json` read by `tokenizers`
    (its normalizer, pre-tokenizer, model, decoder and post-processor as saved), bos / eos from
    `tokenizer_config.json`, and the end-of-generation set from `generation_config.json`'s
    eos_token_id (an int or a list) with tokenizer_config's eos; without generation_config.json,
    eos and the vocabulary's END_OF_GENERATION_TOKENS (as for a GGUF).

    `encode` adds what tokenizer.json's post-processor adds; where tokenizer_config.json sets
    add_bos_token and the post-processor adds no BOS, BOS is prepended (transformers' Llama and
    Gemma tokenizers rebuild their post-processor from that flag). ValueError naming the folder
    when it has no tokenizer.json."""
    folder = os.fspath(folder)
    path = os.path.join(folder, "tokenizer.json")
    if not os.path.isfile(path):
        raise ValueError(
            f"{folder}: no tokenizer.json (the tokenizer of a checkpoint folder is read from it)"
        )
    tok = HFTokenizer.from_file(path)
    config = _read_json(os.path.join(folder, "tokenizer_config.json"))
    generation = _read_json(os.path.join(folder, "generation_config.json"))
    bos, eos = _token_text(config.get("bos_token")), _token_text(config.get("eos_token"))
    bos_id = tok.token_to_id(bos) if bos else generation.get("bos_token_id")
    eos_id = tok.token_to_id(eos) if eos else None
    gen_eos = generation.get("eos_token_id")
    gen_eos = [gen_eos] if isinstance(gen_eos, int) else list(gen_eos or [])
    if eos_id is None and gen_eos:
        eos_id = gen_eos[0]
    adds_bos = bos_id is not None and tok.encode("", add_special_tokens=True).ids[:1] == [bos_id]
    if config.get("add_bos_token") and bos_id is not None and not adds_bos:
        bos_text = tok.id_to_token(bos_id)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos_text} $A", pair=f"{bos_text} $A {bos_text} $B", special_tokens=[(bos_text, bos_id)]
        )
        adds_bos = True
    stop_ids = None  # Tokenizer's default: eos and the vocabulary's END_OF_GENERATION_TOKENS
    if generation:
        stop_ids = gen_eos + ([eos_id] if eos_id is not None else [])
    return Tokenizer(
        tok,
        bos_id=bos_id,
        eos_id=eos_id,
        add_bos=adds_bos,
        pre="tokenizer.json",
        stop_ids=stop_ids,
        chat_template=read_chat_template(folder),
    )
