"""The K3-mini tokenizer: byte-level BPE trained locally, HF tokenizer.json format, K3 special-id offsets."""

import json

import pytest

from k3_model.tokenizer import build_tokenizer, byte_to_unicode, save_tokenizer, synthetic_corpus, train_bpe

TEXTS = ["Hello world, this is K3-mini!", '{"name": "kaistor", "count": 12, "ok": true}',
         "def f(x):\n    return x  + 1\n\n", "tab\there  multiple   spaces", "unicode: héllo wörld ✓ 你好",
         "<|im_user|>user<|im_middle|>hi<|im_end|>", "it's we'll  _under_score__", ""]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(4096, 0)


def test_layout_and_specials(tok):
    assert len(tok.vocab) + len(tok.specials) == 4096 and len(tok.merges) == 3584
    assert sorted(tok.vocab.values()) == list(range(3840))
    assert (tok.specials[3840], tok.specials[3842], tok.specials[4095], tok.specials[4093]) == \
        ("[BOS]", "<|im_end|>", "[PAD]", "<|mask|>")
    assert len(set(byte_to_unicode().values())) == 256


def test_round_trip_and_compression(tok):
    for t in TEXTS:
        assert tok.decode(tok.encode(t)) == t
    assert tok.encode("<|im_end|>") == [3842]
    text = synthetic_corpus(seed=1, n_words=300)  # unseen text of the training distribution
    assert len(tok.encode(text)) < len(text.encode()) / 2  # merges do compress (2.2x measured)


def test_bpe_training_is_deterministic_and_greedy():
    merges = train_bpe("aaab aaab aab", 3)
    assert merges[0] == ("a", "a") and merges == train_bpe("aaab aaab aab", 3)


def test_saved_files_load_in_hf_tokenizers(tok, tmp_path):
    paths = save_tokenizer(tok, tmp_path, bos_id=3840, eos_id=3842, pad_id=4095, model_max_length=4096)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert (cfg["bos_token"], cfg["eos_token"], cfg["pad_token"]) == ("[BOS]", "<|im_end|>", "[PAD]")
    assert {p.name for p in paths} == {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"}
    tokenizers = pytest.importorskip("tokenizers")  # what vLLM / transformers load it with
    hf = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert hf.get_vocab_size() == 4096
    for t in TEXTS:
        assert hf.encode(t).ids == tok.encode(t)
        assert hf.decode(tok.encode(t), skip_special_tokens=False) == t
    with pytest.raises(ValueError, match="not a special token id"):
        save_tokenizer(tok, tmp_path, bos_id=5, eos_id=3842, pad_id=4095, model_max_length=4096)
