"""Tokenizer: a `tokenizers.Tokenizer` plus the special ids the engine needs.

Sources:
* a checkpoint directory: `tokenizer.json` (+ `tokenizer_config.json`, `generation_config.json`);
* a GGUF file: the SentencePiece-BPE vocabulary in its metadata. GGUF keeps no merges, so they are
  rebuilt from the vocabulary: every way to cut a token into two tokens is a merge, ranked by the
  token's position in the file (Gemma's scores do not follow merge order; file order does). Tokens
  made only of spaces are stored with real spaces in GGUF, while the model's normaliser spells a
  space "▁", so they are respelled. GGUF types some control tokens "user-defined" (Gemma 3's
  `<start_of_image>`, `<end_of_image>`, `[multimodal]`) where HF's tokenizer marks them special:
  user-defined tokens that look like control tokens are made special too (HTML tags such as `<b>`
  stay text). The result is cached as `tokenizer.json` beside the model in the user cache, so the
  merge rebuild (~2 s) happens once.
* a Gemma 4 GGUF file (llama.cpp's tokenizer model "gemma4", written from the checkpoint's
  tokenizer.json by convert_hf_to_gguf.py): the same byte-fallback BPE, but the file keeps the pieces
  exactly as tokenizer.json spells them ("▁" for spaces) and the merges themselves
  (`tokenizer.ggml.merges`, "left right" with the split at the first space after the first character),
  so no merge is rebuilt. Special tokens are the CONTROL ones, plus USER_DEFINED or NORMAL ones with
  Gemma 4's control look `<|name>`, `<name|>`, `<|name|>`: the converter types `<|channel>`,
  `<|tool_call>`, `<|"|>`... USER_DEFINED (so that llama.cpp prints them), and tokens that transformers
  does not list among the special ones (`<|image>`, `<|image|>`...) NORMAL. `<turn|>` ends a turn like
  EOS (the file keeps one EOS id; the checkpoint's generation_config lists more). It is cached as the
  Gemma 3 one is (building the BPE takes about a second per 250k merges).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, models, normalizers, processors

from ..errors import UserInputError

# GGUF token types (llama.cpp's llama_token_type).
_NORMAL = 1
_CONTROL = 3
_USER_DEFINED = 4

# Tokens that end a turn in Gemma's chat format; they stop generation like EOS when present.
_TURN_END_TOKENS = ("<end_of_turn>",)
_GEMMA4_TURN_END = "<turn|>"

# A control token by its look: a snake_case name with an underscore in angle brackets, or a name in
# square brackets (HTML tags like <table> or <b> have no underscore and are ordinary text).
_CONTROL_LOOKING = re.compile(r"<[a-z]+(?:_[a-z]+)+>|\[[a-z_]+\]")
# Gemma 4's control tokens: <|turn>, <turn|>, <|image>, <|image|>, <|"|>, <|tool_call>... (a bar after "<",
# before ">" or both).
_GEMMA4_CONTROL_LOOKING = re.compile(r"<\|[^\s<>|]+\|?>|<[^\s<>|]+\|>")
# Special tokens that stand for non-text input (<start_of_image>, <image_soft_token>, Gemma 4's <|audio>).
_MEDIA = re.compile(r"image|audio|video")
_DECODE_BATCH_ABOVE = 4096   # ids; shorter decodes (the detokenizer's, every step) skip the batch overhead
# Bumped when the GGUF -> tokenizer.json conversion changes, so stale cached files are not reused.
_GGUF_CACHE_VERSION = 2
_GEMMA4_CACHE_VERSION = 1   # the same for Gemma 4's tokenizer (build_gemma4_bpe)


@dataclass
class Tokenizer:
    backend: HFTokenizer
    bos_token_id: int | None
    eos_token_id: int
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)
    pad_token_id: int = 0
    special_ids: frozenset[int] = field(default_factory=frozenset)
    byte_ids: frozenset[int] = field(default_factory=frozenset)   # byte-fallback tokens <0xNN>
    chat_template: str | None = None     # Jinja template of the checkpoint, if it ships one

    def __post_init__(self) -> None:
        if not self.special_ids:
            self.special_ids = frozenset(i for i, t in self.backend.get_added_tokens_decoder().items() if t.special)
        if not self.byte_ids:
            self.byte_ids = frozenset(i for b in range(256)
                                      if (i := self.backend.token_to_id(f"<0x{b:02X}>")) is not None)

    def is_special(self, token_id: int) -> bool:
        return token_id in self.special_ids

    @property
    def media_token_ids(self) -> frozenset[int]:
        """Special tokens that stand for images, audio or video: a text-only model must not sample them."""
        return frozenset(i for i in self.special_ids if _MEDIA.search(self.special_text(i)))

    def is_byte_token(self, token_id: int) -> bool:
        return token_id in self.byte_ids

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`, with BOS when the model wants it (post-processor) unless told not to
        (a rendered chat template that already starts with BOS). Through `encode_batch`, which
        releases the GIL (`encode` holds it: 2 MB of text would stall every thread for ~2 s)."""
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def token_text(self, token_id: int) -> str:
        """One token as text, special tokens included (logprobs)."""
        return self.backend.decode([token_id], skip_special_tokens=False)

    def special_text(self, token_id: int | None) -> str:
        return "" if token_id is None else (self.backend.id_to_token(token_id) or "")

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if len(ids) > _DECODE_BATCH_ABOVE:   # long prompts given as ids: decode without holding the GIL
            return self.backend.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0]
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    # -- construction ---------------------------------------------------------------------
    @classmethod
    def from_backend(cls, backend: HFTokenizer, bos: int | None, eos: int, extra_stop: list[int] | None = None,
                     pad: int = 0) -> "Tokenizer":
        stops = {eos, *(extra_stop or [])}
        for tok in _TURN_END_TOKENS:
            tid = backend.token_to_id(tok)
            if tid is not None:
                stops.add(tid)
        return cls(backend, bos, eos, frozenset(stops), pad)

    @classmethod
    def from_checkpoint_dir(cls, path: Path) -> "Tokenizer":
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise UserInputError(f"{path} has no tokenizer.json")
        backend = HFTokenizer.from_file(str(tok_file))
        cfg = _read_json(path / "tokenizer_config.json")
        gen = _read_json(path / "generation_config.json")
        model_cfg = _read_json(path / "config.json")

        def token_id(name: str, default: int | None) -> int | None:
            value = cfg.get(name)
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, str) and backend.token_to_id(value) is not None:
                return backend.token_to_id(value)
            return default

        bos = token_id("bos_token", model_cfg.get("bos_token_id", 2))
        eos_field = gen.get("eos_token_id", model_cfg.get("eos_token_id", 1))
        eos_list = eos_field if isinstance(eos_field, list) else [eos_field]
        eos = token_id("eos_token", eos_list[0])
        if cfg.get("add_bos_token", True) and bos is not None and not _adds_bos(backend, bos):
            _set_bos_post_processor(backend, bos)
        tok = cls.from_backend(backend, bos, eos, [int(e) for e in eos_list], token_id("pad_token", 0) or 0)
        template = cfg.get("chat_template")
        if (path / "chat_template.jinja").is_file():   # newer checkpoints keep it in its own file
            template = (path / "chat_template.jinja").read_text()
        if isinstance(template, list):   # [{"name": "default", "template": ...}, ...]
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        tok.chat_template = template if isinstance(template, str) and template.strip() else None
        return tok

    @classmethod
    def from_gguf(cls, gguf, cache_file: Path | None = None) -> "Tokenizer":
        model_type = gguf.get("tokenizer.ggml.model")
        if model_type not in ("llama", "gemma4"):
            raise UserInputError(f"GGUF tokenizer type {model_type!r} is not supported (expected SentencePiece "
                                 "'llama' or Gemma 4's BPE 'gemma4')")
        bos = gguf.get("tokenizer.ggml.bos_token_id")
        eos = gguf.get("tokenizer.ggml.eos_token_id")
        pad = gguf.get("tokenizer.ggml.padding_token_id", 0)
        if eos is None:
            raise UserInputError("GGUF file lacks tokenizer.ggml.eos_token_id")
        bos_id = bos if gguf.get("tokenizer.ggml.add_bos_token", True) else None
        if model_type == "gemma4":   # the merges are in the file: nothing to rebuild (cached all the same)
            if "tokenizer.ggml.merges" not in gguf.keys():
                raise UserInputError("GGUF tokenizer 'gemma4' lacks tokenizer.ggml.merges")
            if cache_file is not None:
                cache_file = cache_file.with_name(f"{cache_file.stem}.gemma4.v{_GEMMA4_CACHE_VERSION}"
                                                  f"{cache_file.suffix}")
            if cache_file is not None and cache_file.is_file():
                backend = HFTokenizer.from_file(str(cache_file))
            else:
                backend = build_gemma4_bpe(gguf.strings("tokenizer.ggml.tokens"),
                                           [int(t) for t in gguf.get("tokenizer.ggml.token_type")],
                                           gguf.strings("tokenizer.ggml.merges"),
                                           unk_id=gguf.get("tokenizer.ggml.unknown_token_id"), bos_id=bos_id)
                if cache_file is not None:
                    _atomic_save(backend, cache_file)
            stops = [backend.token_to_id(_GEMMA4_TURN_END)]
            stops += [gguf.get("tokenizer.ggml.eot_token_id")]
            tok = cls.from_backend(backend, bos, eos, [int(i) for i in stops if i is not None], pad or 0)
            template = gguf.get("tokenizer.chat_template")
            tok.chat_template = template if isinstance(template, str) and template.strip() else None
            return tok
        if cache_file is not None:
            cache_file = cache_file.with_name(f"{cache_file.stem}.v{_GGUF_CACHE_VERSION}{cache_file.suffix}")
        if cache_file is not None and cache_file.is_file():
            backend = HFTokenizer.from_file(str(cache_file))
        else:
            backend = build_sentencepiece_bpe(
                gguf.strings("tokenizer.ggml.tokens"),
                [int(t) for t in gguf.get("tokenizer.ggml.token_type")],
                unk_id=gguf.get("tokenizer.ggml.unknown_token_id", 3),
                bos_id=bos_id,
            )
            if cache_file is not None:
                _atomic_save(backend, cache_file)
        tok = cls.from_backend(backend, bos, eos, None, pad)
        template = gguf.get("tokenizer.chat_template")
        tok.chat_template = template if isinstance(template, str) and template.strip() else None
        return tok


def build_sentencepiece_bpe(tokens: list[str], token_types: list[int], unk_id: int,
                            bos_id: int | None) -> HFTokenizer:
    """A byte-fallback BPE tokenizer equivalent to the SentencePiece model the vocabulary came from."""
    spelled = [t.replace(" ", "\u2581") if t and not t.strip(" ") else t for t in tokens]
    vocab = {t: i for i, t in enumerate(spelled)}
    merges: list[tuple[str, str]] = []
    for piece in spelled:  # file order = merge priority
        for cut in range(len(piece) - 1, 0, -1):  # longer left part first
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                merges.append((left, right))
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=spelled[unk_id], fuse_unk=True,
                                     byte_fallback=True, dropout=None))
    backend.normalizer = normalizers.Replace(" ", "\u2581")
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    control = [k == _CONTROL or (k == _USER_DEFINED and _CONTROL_LOOKING.fullmatch(t) is not None)
               for t, k in zip(spelled, token_types)]
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True)
                                for t, c in zip(spelled, control) if c])
    backend.add_tokens([AddedToken(t, normalized=False, special=False)
                        for t, k, c in zip(tokens, token_types, control) if k == _USER_DEFINED and not c and t in vocab])
    if bos_id is not None:
        _set_bos_post_processor(backend, bos_id)
    return backend


def build_gemma4_bpe(tokens: list[str], token_types: list[int], merges: list[str], unk_id: int | None,
                     bos_id: int | None) -> HFTokenizer:
    """Gemma 4's tokenizer from a GGUF file's pieces and merges: byte-fallback BPE over the text with spaces
    spelled "▁" (as the checkpoint's tokenizer.json; llama.cpp's own pre-split at newline runs changes no
    result where no merge joins a newline to another character)."""
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    pairs: list[tuple[str, str]] = []
    for i, m in enumerate(merges):
        cut = m.find(" ", 1)   # llama.cpp's reading: the first space after the first character
        if cut < 0:
            raise UserInputError(f"GGUF merge {i} {m!r} is not 'left right'")
        pairs.append((m[:cut], m[cut + 1:]))
    unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
    try:
        backend = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, unk_token=unk, fuse_unk=True,
                                         byte_fallback=True, dropout=None))
    except Exception as exc:   # tokenizers refuses merges of pieces the vocabulary lacks
        raise UserInputError(f"GGUF tokenizer merges do not fit its tokens: {exc}") from None
    backend.normalizer = normalizers.Replace(" ", "\u2581")
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    control = [k == _CONTROL or (k in (_USER_DEFINED, _NORMAL) and _GEMMA4_CONTROL_LOOKING.fullmatch(t) is not None)
               for t, k in zip(tokens, token_types)]
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True)
                                for t, c in zip(tokens, control) if c])
    backend.add_tokens([AddedToken(t, normalized=False, special=False)
                        for t, k, c in zip(tokens, token_types, control) if k == _USER_DEFINED and not c])
    if bos_id is not None:
        _set_bos_post_processor(backend, bos_id)
    return backend


def _set_bos_post_processor(backend: HFTokenizer, bos_id: int) -> None:
    bos = backend.id_to_token(bos_id)
    backend.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])


def _adds_bos(backend: HFTokenizer, bos_id: int) -> bool:
    ids = backend.encode("a", add_special_tokens=True).ids
    return bool(ids) and ids[0] == bos_id


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    with path.open() as fh:
        return json.load(fh)


def _atomic_save(backend: HFTokenizer, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(target.suffix + ".tmp")
    backend.save(str(tmp))
    tmp.replace(target)
