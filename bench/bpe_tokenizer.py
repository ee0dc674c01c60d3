"""A byte-level BPE tokenizer for random-weight models, sized to the model's vocabulary, so that structured
outputs (JSON schemas, regexes) can be satisfied: every byte is a token, and merges cover JSON and English.

    save_bpe_tokenizer(151936, eos_token_id=151643, out_dir=path)   # ~2 s, tokenizer.json ~3 MB

Built without a hub, in Qwen2's form: its pre-tokenizer (the split regex that keeps digits single, then
byte-level) and byte-level decoder, the vocabulary type xgrammar and llguidance read as byte-level. A BPE is
trained on a seeded synthetic corpus of JSON records and English words (at most `TRAINED` tokens: the 256
bytes and the merges), then padded to exactly `vocab_size` entries, so that ids, the logits' width and the
tokenizer agree on every server. Padding tokens are concatenations of two trained tokens that the
pre-tokenizer keeps in one piece (` thing`, `":{"`, never `12` or ` the":`), as every entry of a real BPE
vocabulary is: a random model then walks a JSON grammar the way it would with Qwen's vocabulary (numbers a
digit a token end soon; strings, keys and punctuation all come up) rather than writing one endless number.
They have no merges, so encoding never produces them, but they decode like any other token. The EOS token
`<|endoftext|>` sits at the model's eos_token_id, the only special token.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

EOS_TEXT = "<|endoftext|>"
# Qwen2's pre-tokenizer split (tokenizer.json of Qwen2.5): letters runs, one digit, punctuation runs, spaces.
QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
               r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
TRAINED = 4096  # vocabulary the BPE trainer aims for (bytes + merges), before padding
WORDS = ("the of and to in is that for it as was with be by on not he this are or his from at which but have "
         "an they you were her she there been one all we their has would when if so no what up out more about "
         "into than them can only other new some could time these two may then do first any my now such like "
         "our over man me even most made after also did many before must through back years where much your way "
         "well down should because each just those people how too little state good very make world still own "
         "see men work long get here between both life being under never day same another know while last might "
         "us great old year off come since against go came right used take three server request token model "
         "status open closed pending title owner name email score tags id value true false null").split()


def _json_record(rng: random.Random) -> str:
    words = lambda k: " ".join(rng.choice(WORDS) for _ in range(k))  # noqa: E731
    record = {"id": rng.randrange(10 ** rng.randint(1, 9)), "title": words(rng.randint(1, 8)),
              "status": rng.choice(["open", "closed", "pending"]),
              "tags": [rng.choice(WORDS) for _ in range(rng.randint(0, 5))],
              "owner": {"name": words(2).title(), "email": f"{rng.choice(WORDS)}.{rng.choice(WORDS)}@example.com"},
              "score": round(rng.uniform(-1000, 1000), rng.randint(0, 4)), "ok": rng.choice([True, False, None])}
    indent = rng.choice([None, None, 2])
    separators = (", ", ": ") if rng.random() < 0.5 else (",", ":")
    return json.dumps(record, indent=indent, separators=None if indent else separators)


def synthetic_corpus(seed: int = 0, records: int = 3000, sentences: int = 3000) -> list[str]:
    """JSON records (compact and spaced, nested, numbers, emails) and English-like sentences, seeded."""
    rng = random.Random(seed)
    text = [_json_record(rng) for _ in range(records)]
    for _ in range(sentences):
        sentence = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 20)))
        text.append(sentence[0].upper() + sentence[1:] + rng.choice([".", "?", "!", ",", ";"]))
    return text


def qwen2_pre_tokenizer():
    from tokenizers import Regex, pre_tokenizers

    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def _trained(seed: int, target: int) -> tuple[list[str], list]:
    """(the trained tokens in id order, the merges) of a ByteLevel BPE on the synthetic corpus."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = qwen2_pre_tokenizer()
    trainer = trainers.BpeTrainer(vocab_size=target, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(synthetic_corpus(seed), trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    vocab = sorted(model["vocab"].items(), key=lambda kv: kv[1])
    return [t for t, _ in vocab], model["merges"]


def padded_vocab(trained: list[str], vocab_size: int, eos_token_id: int, seed: int = 0) -> dict[str, int]:
    """`vocab_size` distinct tokens: the trained ones first, EOS at eos_token_id, and in every other slot a
    seeded pair of trained tokens that is one piece for the pre-tokenizer (and whole UTF-8)."""
    from tokenizers import Regex, decoders, pre_tokenizers

    split, decode = pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"), decoders.ByteLevel().decode
    tokens = list(trained[: vocab_size - 1])
    seen, rng = set(tokens) | {EOS_TEXT}, random.Random(seed)
    for _ in range(50 * vocab_size):
        if len(tokens) >= vocab_size - 1:
            break
        pair = rng.choice(trained) + rng.choice(trained)
        text = decode([pair])
        if pair not in seen and "\ufffd" not in text and len(split.pre_tokenize_str(text)) == 1:
            seen.add(pair)
            tokens.append(pair)
    if len(tokens) < vocab_size - 1:
        raise ValueError(f"could not pad a BPE of {len(trained)} tokens to {vocab_size} with one-piece pairs")
    tokens.insert(eos_token_id, EOS_TEXT)
    return {t: i for i, t in enumerate(tokens)}


def bpe_tokenizer(vocab_size: int, eos_token_id: int, seed: int = 0):
    """The `tokenizers.Tokenizer` (ByteLevel BPE, `vocab_size` entries, EOS special at eos_token_id)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    if vocab_size < 257 or not 0 <= eos_token_id < vocab_size:
        raise ValueError(f"a byte-level BPE needs vocab_size >= 257 (256 bytes + EOS) and 0 <= eos_token_id < "
                         f"vocab_size; got {vocab_size}, {eos_token_id}")
    trained, merges = _trained(seed, min(TRAINED, vocab_size - 1))
    vocab = padded_vocab(trained, vocab_size, eos_token_id, seed)
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(models.BPE(vocab, [m for m in merges if m[0] + m[1] in vocab]))
    tok.pre_tokenizer = qwen2_pre_tokenizer()
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([AddedToken(EOS_TEXT, special=True, normalized=False)])
    assert tok.get_vocab_size() == vocab_size and tok.token_to_id(EOS_TEXT) == eos_token_id
    return tok


def save_bpe_tokenizer(vocab_size: int, eos_token_id: int, out_dir: Path, seed: int = 0) -> None:
    """tokenizer.json and tokenizer_config.json (PreTrainedTokenizerFast, EOS and pad `<|endoftext|>`, no BOS),
    written directly: transformers' AutoTokenizer, llguidance and xgrammar (vLLM's default) all load them."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    bpe_tokenizer(vocab_size, eos_token_id, seed).save(str(out_dir / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS_TEXT, "pad_token": EOS_TEXT,
              "bos_token": None, "unk_token": None, "model_max_length": 1 << 20, "clean_up_tokenization_spaces": False,
              "added_tokens_decoder": {str(eos_token_id): {"content": EOS_TEXT, "special": True, "lstrip": False,
                                                           "rstrip": False, "normalized": False,
                                                           "single_word": False}}}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
