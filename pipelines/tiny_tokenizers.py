"""Small offline tokenizers for the tiny pipelines (no downloads): WordPiece over a built-in English
vocabulary, shaped like the Llama, T5 and CLIP tokenizers the real pipelines use."""
from __future__ import annotations

from typing import Any

__all__ = ["tiny_tokenizer"]

# --------------------------------------------------------------------------- #
# Tokenizers
# --------------------------------------------------------------------------- #

# Words of the HunyuanVideo prompt template (all whole-word tokens, except
# "behaviors" which deliberately splits as "behavior" + "##s", so that the
# template prefix is exactly 95 tokens = the pipeline's hardcoded crop_start).
_TEMPLATE_WORDS = """
system describe the video by detailing following aspects main content and theme of
color shape size texture quantity text spatial relationships objects actions events
behavior temporal physical movement changes background environment light style
atmosphere camera angles movements transitions used in user
""".split()

_COMMON_WORDS = """
a an this that these those is are was were be been being it its they them their there
here he she his her we you i my your our of to for with on at from into onto over under
above below behind between through across around near far up down left right front back
inside outside out off and or but not no yes very more most less few many much some all
each every other another one two three four five six seven eight nine ten first last
next new old young big small large little tiny huge tall short long wide narrow high low
hot cold warm cool bright dark light heavy soft hard fast slow quick quiet loud beautiful
pretty ugly happy sad angry calm busy empty full clean dirty wet dry red orange yellow
green blue purple pink brown black white gray grey golden silver man woman boy girl child
children people person baby family friend crowd dog cat bird horse cow fish bear lion
tiger elephant monkey rabbit fox wolf deer duck chicken car bus train plane boat ship bike
bicycle truck road street city town village house home building tower bridge room kitchen
window door table chair bed wall floor roof garden park forest tree trees flower flowers
grass leaf leaves mountain mountains hill river lake sea ocean beach sand wave waves water
rain snow ice fire smoke sky cloud clouds sun moon star stars night day morning evening
sunset sunrise winter summer spring autumn weather wind storm field farm desert island
walk walks walking run runs running jump jumps jumping fly flies flying swim swims swimming
dance dances dancing sing sings singing play plays playing eat eats eating drink drinks
drinking sit sits sitting stand stands standing look looks looking watch watches watching
move moves moving turn turns turning ride rides riding drive drives driving hold holds
holding open opens close closes fall falls falling rise rises rising smile smiles smiling
talk talks talking read reads reading write writes writing cook cooks cooking work works
working sleep sleeps sleeping wear wears wearing carry carries carrying throw throws catch
catches push pull chase chases slowly quickly gently together alone while during before
after then when where what who how why as like than so too also just only still again ever
never always often together background foreground scene shot view close wide aerial camera
pan pans zoom zooms tracking cinematic realistic photo film movie animation cartoon style
painting art drawing detailed high quality resolution lighting shadow shadows reflection
glass metal wood wooden stone paper plastic glowing shiny colorful vibrant soft gentle
hat shirt dress coat shoes glasses ball book phone computer guitar piano music song game
food bread apple cake coffee tea wine cup bowl plate box bag hand hands face eyes hair head
""".split()

_PUNCT = list(".,:;!?'\"()[]{}-_/\\&%$#@*+=<>|~`^")
_CHARS = list("abcdefghijklmnopqrstuvwxyz0123456789")

# (bos, eos, pad, unk, extra specials, post-processor template)
_TOKENIZER_SPECS: dict[str, dict[str, Any]] = {
    # Llama-3 style: <|begin_of_text|> prepended, chat-header specials.
    "llama": dict(
        bos="<|begin_of_text|>",
        eos="<|end_of_text|>",
        pad="<|pad|>",
        unk="<|unk|>",
        extra=["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        single="{bos} $A",
        model_max_length=1024,
    ),
    # UMT5 style: </s> appended, <pad> is id 0.
    "t5": dict(
        bos="<s>",
        eos="</s>",
        pad="<pad>",
        unk="<unk>",
        extra=[],
        single="$A {eos}",
        model_max_length=1024,
        pad_first=True,
    ),
    # CLIP style: <|startoftext|> ... <|endoftext|>, 77 positions.
    "clip": dict(
        bos="<|startoftext|>",
        eos="<|endoftext|>",
        pad="<|pad|>",
        unk="<|unk|>",
        extra=[],
        single="{bos} $A {eos}",
        model_max_length=77,
    ),
}


def _vocab_words() -> list[str]:
    seen: dict[str, None] = {}
    for w in _TEMPLATE_WORDS + _COMMON_WORDS + _CHARS + _PUNCT:
        seen.setdefault(w, None)
    seen.pop("behaviors", None)  # keep the template prefix at exactly 95 tokens (see _TEMPLATE_WORDS)
    for c in _CHARS:
        seen.setdefault("##" + c, None)
    seen.setdefault("\n", None)
    seen.setdefault("\n\n", None)
    return list(seen)


def tiny_tokenizer(kind: str = "llama", extra_words: tuple[str, ...] = ()):
    """A small offline ``PreTrainedTokenizerFast`` (kind: "llama", "t5" or "clip").

    WordPiece over a built-in English vocabulary, lowercasing, single-character
    fallback (``##x`` pieces) so any ASCII text maps to distinct ids, newlines
    kept as tokens ("\\n\\n" is one token, as in Llama 3).

    ``extra_words``: whole-word tokens appended after the built-in vocabulary (the ids of every
    other token stay as they are, so a text encoder trained on the plain vocabulary keeps its
    embedding rows and only grows new ones). tiny-shapes uses it for the caption words the
    built-in vocabulary lacks ("circle", "square", "triangle" would otherwise be spelt letter by
    letter).
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    if kind not in _TOKENIZER_SPECS:
        raise ValueError(f"unknown tokenizer kind {kind!r}; expected one of {tuple(_TOKENIZER_SPECS)}")
    spec = _TOKENIZER_SPECS[kind]
    specials = [spec["pad"], spec["bos"], spec["eos"], spec["unk"]] if spec.get("pad_first") else [
        spec["bos"], spec["eos"], spec["unk"], spec["pad"]]
    specials = specials + list(spec["extra"])
    tokens = specials + [w for w in _vocab_words() if w not in specials]
    tokens += [w for w in dict.fromkeys(w.lower() for w in extra_words) if w not in tokens]
    vocab = {t: i for i, t in enumerate(tokens)}

    tok = Tokenizer(models.WordPiece(vocab, unk_token=spec["unk"], max_input_chars_per_word=64))
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    # keep: runs of newlines, words, single punctuation characters; drop spaces/tabs
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"[^\S\n]+"), behavior="removed"),
        pre_tokenizers.Split(Regex(r"\n+|[^\w\s]"), behavior="isolated"),
    ])
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.add_special_tokens(specials)
    single = spec["single"].format(bos=spec["bos"], eos=spec["eos"])
    used = [s for s in (spec["bos"], spec["eos"]) if s in single.split()]
    tok.post_processor = processors.TemplateProcessing(
        single=single,
        pair=single + " $B",
        special_tokens=[(s, vocab[s]) for s in used],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=spec["bos"],
        eos_token=spec["eos"],
        pad_token=spec["pad"],
        unk_token=spec["unk"],
        additional_special_tokens=list(spec["extra"]) or None,
        model_max_length=spec["model_max_length"],
        padding_side="right",
        truncation_side="right",
    )
