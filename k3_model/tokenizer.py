"""A small byte-level BPE tokenizer for K3-mini, trained here on generated text (no hub, no extra package).

The result is written in the Hugging Face ``tokenizer.json`` format (BPE model, ByteLevel
pre-tokenizer and decoder), so ``transformers.PreTrainedTokenizerFast`` and vLLM load it from the
checkpoint folder (``tokenizer=<dir>``). Layout of the 4096 ids (mirroring K3's 163840, where the
specials sit in the top 256 ids):

- 0..255: the 256 bytes (id = byte value), so every string is encodable;
- 256..V-257: BPE merges learned on :func:`synthetic_corpus` (a deterministic pseudo-language with
  digits, punctuation, JSON and code-like lines); ids left over if the corpus runs out of pairs are
  reserved specials;
- V-256..V-1: specials: ``[BOS]`` = V-256 (config ``bos_token_id``), ``[EOS]`` = V-255,
  ``<|im_end|>`` = V-254 (config ``eos_token_id``, the end-of-turn token), ``<|im_user|>``,
  ``<|im_assistant|>``, ``<|im_system|>``, ``<|im_middle|>`` = V-250, ``<|mask|>`` = V-3 (the DSpark
  mask slot), ``[PAD]`` = V-1 (config ``pad_token_id``); the rest ``<|reserved_token_N|>``.

The Python :class:`ByteBPE` encodes and decodes the same way as the JSON (used by the tests and
by tools that must not depend on ``tokenizers``); its pre-tokenizer is GPT-2's pattern written with
Python ``re`` classes (``[^\\W\\d_]`` = letters), identical on ASCII text.

Source: k3_architecture.md §1 (bos V-256, eos V-254, pad V-1), §9 (token-id offsets mirror the real
vocab; DSpark mask V-3); shared/reference/vllm_cpu.md §2 (a locally trained byte-level BPE loads in
vLLM and xgrammar). The special-token names beyond the ids are [I]: Kimi's chat markers.
"""

from __future__ import annotations

import heapq
import json
import random
import re
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

PRETOKENIZE = re.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?[^\W\d_]+| ?\d+| ?(?:[^\s\w]|_)+|\s+(?!\S)|\s+""")
"""GPT-2's split pattern (the ByteLevel pre-tokenizer's ``use_regex``), in Python ``re`` terms."""


def byte_to_unicode() -> dict[int, str]:
    """The ByteLevel alphabet: printable Latin-1 bytes map to themselves, the other 68 bytes to
    ``chr(256 + n)`` in byte order (so no symbol is whitespace or a control character)."""
    keep = [b for b in range(256) if 33 <= b <= 126 or 161 <= b <= 172 or 174 <= b <= 255]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def special_tokens(vocab_size: int) -> dict[int, str]:
    """id -> content of the 256 specials at the top of the vocabulary (see the module docstring)."""
    V = vocab_size
    named = {V - 256: "[BOS]", V - 255: "[EOS]", V - 254: "<|im_end|>", V - 253: "<|im_user|>",
             V - 252: "<|im_assistant|>", V - 251: "<|im_system|>", V - 250: "<|im_middle|>",
             V - 3: "<|mask|>", V - 1: "[PAD]"}
    return {i: named.get(i, f"<|reserved_token_{i}|>") for i in range(V - 256, V)}


_ONSETS = ["", "b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "z",
           "br", "ch", "dr", "gl", "kr", "pl", "sh", "st", "th", "tr"]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ea", "ou", "y"]
_CODAS = ["", "", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ng"]


def synthetic_corpus(seed: int = 0, n_words: int = 60000) -> str:
    """Deterministic training text: sentences of a syllable pseudo-language with Zipf word
    frequencies, capitalised starts, numbers, punctuation, JSON objects and code-like lines.

    Args:
        seed: RNG seed. n_words: approximate length (words).

    Returns:
        The text (ASCII).
    """
    rng = random.Random(seed)
    lexicon = sorted({"".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)
                              for _ in range(rng.randint(1, 4))) for _ in range(5000)})
    rng.shuffle(lexicon)
    weights = [1.0 / (r + 1) for r in range(len(lexicon))]
    lines, count = [], 0
    while count < n_words:
        kind = rng.random()
        if kind < 0.75:
            words = rng.choices(lexicon, weights, k=rng.randint(4, 18))
            words[0] = words[0].capitalize()
            if rng.random() < 0.3:
                words.insert(rng.randrange(len(words)), str(rng.randint(0, 10 ** rng.randint(1, 4))))
            lines.append(" ".join(words) + rng.choice([".", ".", ".", "?", "!", ",", ";", ":"]))
        elif kind < 0.9:
            keys = rng.choices(lexicon[:200], k=rng.randint(1, 4))
            vals = [rng.choice([f'"{rng.choice(lexicon)}"', str(rng.randint(0, 999)), "true", "false", "null"])
                    for _ in keys]
            lines.append("{" + ", ".join(f'"{k}": {v}' for k, v in zip(keys, vals)) + "}")
        else:
            a, b = rng.choices(lexicon[:300], k=2)
            lines.append(f"def {a}_{b}(x, n={rng.randint(0, 9)}):\n    return x.{a}(n) + {rng.randint(1, 99)}")
        count += len(lines[-1].split())
    return "\n".join(lines) + "\n"


def _pairs(symbols: list[str]) -> Counter[tuple[str, str]]:
    return Counter(zip(symbols, symbols[1:]))


def train_bpe(text: str, num_merges: int) -> list[tuple[str, str]]:
    """Learn up to ``num_merges`` byte-level BPE merges from ``text`` (most frequent pair first,
    ties broken by the pair's symbols in lexicographic order, so the result is deterministic).

    Returns:
        The merges in rank order (fewer if the text runs out of pairs).
    """
    b2u = byte_to_unicode()
    freq = Counter(PRETOKENIZE.findall(text))
    words = [[b2u[b] for b in w.encode("utf-8")] for w in freq]
    counts = list(freq.values())
    pair_count: Counter[tuple[str, str]] = Counter()
    where: dict[tuple[str, str], set[int]] = {}
    for i, w in enumerate(words):
        for p, n in _pairs(w).items():
            pair_count[p] += n * counts[i]
            where.setdefault(p, set()).add(i)
    heap = [(-c, p) for p, c in pair_count.items()]
    heapq.heapify(heap)
    merges: list[tuple[str, str]] = []
    while heap and len(merges) < num_merges:
        neg, pair = heapq.heappop(heap)
        if pair_count.get(pair, 0) != -neg or -neg <= 0:
            continue  # stale entry
        merges.append(pair)
        a, b = pair
        for i in sorted(where.pop(pair, ())):
            w = words[i]
            before = _pairs(w)
            out, j = [], 0
            while j < len(w):
                if j + 1 < len(w) and w[j] == a and w[j + 1] == b:
                    out.append(a + b)
                    j += 2
                else:
                    out.append(w[j])
                    j += 1
            words[i] = out
            after = _pairs(out)
            for p in set(before) | set(after):
                delta = (after.get(p, 0) - before.get(p, 0)) * counts[i]
                if delta == 0:
                    continue
                pair_count[p] += delta
                if after.get(p, 0):
                    where.setdefault(p, set()).add(i)
                elif p in where:
                    where[p].discard(i)
                if p != pair and pair_count[p] > 0:
                    heapq.heappush(heap, (-pair_count[p], p))
        pair_count.pop(pair, None)
    return merges


class ByteBPE:
    """Encode / decode with a byte-level BPE (the same rules as the ``tokenizer.json`` it writes).

    Args:
        vocab: token string -> id for the BPE part (bytes and merges).
        merges: merge pairs in rank order.
        specials: id -> content of the special tokens (matched verbatim before pre-tokenizing).
    """

    def __init__(self, vocab: dict[str, int], merges: list[tuple[str, str]], specials: dict[int, str]) -> None:
        self.vocab, self.merges, self.specials = vocab, merges, specials
        self.rank = {p: r for r, p in enumerate(merges)}
        self.id_to_token = {i: t for t, i in vocab.items()} | specials
        self.special_ids = {c: i for i, c in specials.items()}
        self._b2u = byte_to_unicode()
        self._u2b = {u: b for b, u in self._b2u.items()}
        self._special_re = re.compile("|".join(re.escape(c) for c in sorted(self.special_ids, key=len, reverse=True)))

    def _bpe(self, word: str) -> list[str]:
        syms = [self._b2u[b] for b in word.encode("utf-8")]
        while len(syms) > 1:
            ranked = [(self.rank.get(p, len(self.rank)), i) for i, p in enumerate(zip(syms, syms[1:]))]
            r, i = min(ranked)
            if r == len(self.rank):
                break
            a, b = self.merges[r]
            out, j = [], 0
            while j < len(syms):
                if j + 1 < len(syms) and syms[j] == a and syms[j + 1] == b:
                    out.append(a + b)
                    j += 2
                else:
                    out.append(syms[j])
                    j += 1
            syms = out
        return syms

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (special-token strings become their ids; no BOS added)."""
        ids: list[int] = []
        pos = 0
        for m in [*self._special_re.finditer(text), None]:
            chunk = text[pos:m.start()] if m else text[pos:]
            for word in PRETOKENIZE.findall(chunk):
                ids.extend(self.vocab[s] for s in self._bpe(word))
            if m:
                ids.append(self.special_ids[m.group()])
                pos = m.end()
        return ids

    def decode(self, ids: Iterable[int], *, skip_special: bool = False) -> str:
        """Text of ``ids`` (invalid UTF-8 byte runs become U+FFFD)."""
        out, buf = [], bytearray()
        for i in ids:
            if i in self.specials:
                out.append(buf.decode("utf-8", "replace"))
                buf = bytearray()
                if not skip_special:
                    out.append(self.specials[i])
                continue
            buf.extend(self._u2b[c] for c in self.id_to_token[i])
        out.append(buf.decode("utf-8", "replace"))
        return "".join(out)

    def tokenizer_json(self) -> dict[str, Any]:
        """The Hugging Face ``tokenizer.json`` document."""
        added = [{"id": i, "content": c, "single_word": False, "lstrip": False, "rstrip": False,
                  "normalized": False, "special": True} for i, c in sorted(self.specials.items())]
        return {
            "version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
            "post_processor": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
            "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                      "vocab": dict(sorted(self.vocab.items(), key=lambda kv: kv[1])),
                      "merges": [f"{a} {b}" for a, b in self.merges]},
        }


CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}<|im_system|>system<|im_middle|>"
    "{% elif m['role'] == 'user' %}<|im_user|>user<|im_middle|>"
    "{% else %}<|im_assistant|>assistant<|im_middle|>{% endif %}"
    "{{ m['content'] }}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}"
)
"""Kimi-style chat markup (the role markers of :func:`special_tokens`)."""


def build_tokenizer(vocab_size: int = 4096, seed: int = 0) -> ByteBPE:
    """Train the K3-mini tokenizer: 256 byte ids, merges up to ``vocab_size - 256``, 256 specials on top.

    Raises:
        ValueError: ``vocab_size`` leaves no room for the bytes and the 256 specials (< 512).
    """
    if vocab_size < 512:
        raise ValueError(f"build_tokenizer: vocab_size {vocab_size} must be >= 512 (256 bytes + 256 specials).")
    b2u = byte_to_unicode()
    vocab = {b2u[b]: b for b in range(256)}
    merges = []
    for a, b in train_bpe(synthetic_corpus(seed), vocab_size - 512):
        merges.append((a, b))
        if a + b not in vocab:  # two merges may build the same string; it keeps one id
            vocab[a + b] = len(vocab)
    specials = special_tokens(vocab_size)
    for i in range(len(vocab), vocab_size - 256):  # corpus ran out of pairs: reserve the rest
        specials[i] = f"<|reserved_token_{i}|>"
    return ByteBPE(vocab, merges, dict(sorted(specials.items())))


def save_tokenizer(tok: ByteBPE, out_dir: str | Path, *, bos_id: int, eos_id: int, pad_id: int,
                   model_max_length: int) -> list[Path]:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json``.

    Args:
        tok: the tokenizer. out_dir: checkpoint folder.
        bos_id, eos_id, pad_id: ids from config.json (must be specials of ``tok``).
        model_max_length: context limit (tokens).

    Returns:
        The written paths.

    Raises:
        ValueError: an id is not one of the tokenizer's specials.
    """
    out = Path(out_dir)
    for name, i in (("bos", bos_id), ("eos", eos_id), ("pad", pad_id)):
        if i not in tok.specials:
            raise ValueError(f"save_tokenizer: {name}_token_id {i} is not a special token id of the tokenizer.")
    names = {"bos_token": tok.specials[bos_id], "eos_token": tok.specials[eos_id], "pad_token": tok.specials[pad_id]}
    files = {
        "tokenizer.json": tok.tokenizer_json(),
        "tokenizer_config.json": {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": model_max_length,
                                  "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
                                  "chat_template": CHAT_TEMPLATE, **names},
        "special_tokens_map.json": names,
    }
    paths = []
    for name, doc in files.items():
        p = out / name
        p.write_text(json.dumps(doc, ensure_ascii=False, indent=1 if name != "tokenizer.json" else None) + "\n",
                     encoding="utf-8")
        paths.append(p)
    return paths
