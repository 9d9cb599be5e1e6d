"""kvstack's tokenizer against llama.cpp (llama-cpp-python) on the default model.

A seeded generator builds a corpus of >= 2,000 strings (prose, code, whitespace
runs, numbers, punctuation, CJK, Arabic, emoji sequences, combining marks,
Hangul, Devanagari, unusual codepoints, special-token text, invalid UTF-8).
kvstack runs once per mode in batch (--jsonl) and every string must give the
same ids as llama_tokenize, and the same bytes as llama_detokenize; valid
UTF-8 must round-trip exactly.

Env: KVSTACK_BIN (kvstack executable), KVSTACK_MODEL (GGUF path). CTest runs
this file on SmolLM2 (test_tokenizer: byte-level BPE) and on Gemma 3
(test_tokenizer_gemma3: SentencePiece with byte fallback, user-defined tokens).
"""

import ctypes
import json
import os
import random
import subprocess

import pytest

from conftest import KVSTACK_BIN as BIN, MODEL

llama_cpp = pytest.importorskip("llama_cpp")


# ----------------------------------------------------------------- corpus

WORDS = ("the of and to in a is that for it as was with be by on not he I this are or his from "
         "at which but have an had they you were their one all we can her has there been if more "
         "when will would who so no Memory cache TOKEN Tokenizer naïve café résumé façade don't "
         "I'm we'll they've she'd it's YOU'RE O'Neil rock'n'roll").split()
CODE = [
    "def f(x):\n    return x ** 2  # square\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i] * b[i];\n}\n",
    "if __name__ == '__main__':\n    main()\n",
    "const auto it = std::find_if(v.begin(), v.end(), [&](int x) { return x > 0; });",
    "SELECT id, name FROM users WHERE age >= 18 ORDER BY name DESC;",
    "<div class=\"x\">&nbsp;<a href='/p?q=1&r=2'>link</a></div>",
    "x = {'a': [1, 2, 3], \"b\": None}\nprint(f\"{x!r:>10}\")",
    "#include <stdio.h>\nint main(void){printf(\"%d\\n\", 42);}",
    "    indented\n        more\n\t\ttabs\n",
    "a=>b ->c <<= >>= != === !== && || ?? ::",
]
SPACES = [" ", "  ", "\t", "\n", "\r\n", "\r", "\v", "\f", "\u00a0", "\u3000", "\u2003", "\u2028",
          "\u0085", "\u1680", "\u202f", "\u205f"]
PUNCT = list("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~") + ["...", "…", "—", "–", "«", "»", "“", "”",
                                                      "‘", "’", "¿", "¡", "§", "¶", "•", "©",
                                                      "™", "°", "±", "×", "÷", "€", "£", "¥"]
NUMBERS = ["0", "7", "42", "123", "1234", "12345", "3.14159", "1,000,000", "-273.15", "1e-9",
           "0x1F", "2024-05-09", "٣٤٥", "१२३", "１２３", "²³", "½", "¾", "Ⅻ", "⑤", "𝟙𝟚"]
EMOJI_BASE = ["👍", "👋", "🙏", "💪", "👩", "👨", "🧑", "👧", "😀", "🎉", "❤", "🔥", "🚀", "🤖"]
SKIN = ["\U0001F3FB", "\U0001F3FC", "\U0001F3FD", "\U0001F3FE", "\U0001F3FF"]
ZWJ_SEQ = ["👩\u200d💻", "👨\u200d👩\u200d👧\u200d👦", "🏳\ufe0f\u200d🌈", "👩🏽\u200d🚀",
           "🧑\u200d🤝\u200d🧑", "❤\ufe0f\u200d🔥", "1\ufe0f\u20e3", "🇯🇵", "🇺🇸🇫🇷", "#️⃣"]
COMBINING = ["\u0301", "\u0300", "\u0308", "\u0327", "\u0303", "\u20dd", "\u0336", "\u034f"]
UNUSUAL = ["\ue000", "\uf8ff", "\U000f0000", "\U0010fffd", "\ufdd0", "\ufffe", "\uffff",
           "\U0010ffff", "\u0378", "\u0000", "\u0001", "\u001f", "\u007f", "\u0085", "\ufeff",
           "\u200b", "\u200e", "\u202e", "\u2066", "\U0002ebf0", "\u31ef", "\U00016d40",
           "\U0001fae8", "\ufffd", "\U000e0041", "\ud7ff", "\U0001d11e"]
SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<reponame>", "<file_sep>",
            "<jupyter_code>", "<empty_output>", "<|im_sta", "im_end|>", "<|", "|>",
            # Gemma 3: control tokens, user-defined tokens (HTML tags, whitespace
            # runs, image markers) and near misses; plain text for SmolLM2.
            "<start_of_turn>", "<end_of_turn>", "<bos>", "<eos>", "<pad>", "<unk>", "<mask>",
            "<unused7>", "<start_of_image>", "<end_of_image>", "[multimodal]", "<table>", "</td>",
            "<s>", "</s>", "<strong>", "<start_of_tur", "end_of_turn>", "<unused", "\n\n\n",
            "\t\t\t\t", "        "]


def rand_range(rng, lo, hi, n):
    return "".join(chr(rng.randint(lo, hi)) for _ in range(n))


def gen_prose(rng):
    out = []
    for i in range(rng.randint(1, 25)):
        w = rng.choice(WORDS)
        if i == 0 or rng.random() < 0.1:
            w = w.capitalize()
        out.append(w + (rng.choice([",", ".", "!", "?", ";", ":"]) if rng.random() < 0.15 else ""))
    return " ".join(out)


def gen_code(rng):
    return "".join(rng.choice(CODE) for _ in range(rng.randint(1, 3)))


def gen_whitespace(rng):
    parts = []
    for _ in range(rng.randint(1, 8)):
        parts.append("".join(rng.choice(SPACES) for _ in range(rng.randint(1, 40))))
        if rng.random() < 0.7:
            parts.append(rng.choice(WORDS + PUNCT + NUMBERS))
    return "".join(parts)


def gen_numbers(rng):
    seps = ["", " ", ",", ".", "-", "+", "/", ":", "x"]
    s = "".join(rng.choice(NUMBERS) + rng.choice(seps) for _ in range(rng.randint(1, 8)))
    if rng.random() < 0.3:
        s += str(rng.randint(0, 10 ** rng.randint(1, 30)))
    return s


def gen_punct(rng):
    return "".join(rng.choice(PUNCT) * rng.randint(1, 4) + rng.choice(["", " ", "a", "\n"])
                   for _ in range(rng.randint(1, 10)))


def gen_cjk(rng):
    parts = [rand_range(rng, 0x4E00, 0x9FFF, rng.randint(1, 12)),
             rand_range(rng, 0x3041, 0x3096, rng.randint(0, 6)),
             rand_range(rng, 0x30A1, 0x30FA, rng.randint(0, 6)),
             rng.choice(["，", "。", "、", "「", "」", "！", "？", " ", ""])]
    rng.shuffle(parts)
    return "".join(parts)


def gen_arabic(rng):
    words = []
    for _ in range(rng.randint(1, 6)):
        w = rand_range(rng, 0x0621, 0x064A, rng.randint(1, 7))
        if rng.random() < 0.5:
            w += rand_range(rng, 0x064B, 0x0652, 1)  # harakat
        words.append(w)
    return " ".join(words) + rng.choice(["", "؟", "،", " ٣٤", "."])


def gen_emoji(rng):
    out = []
    for _ in range(rng.randint(1, 6)):
        r = rng.random()
        if r < 0.4:
            out.append(rng.choice(EMOJI_BASE) + rng.choice(SKIN))
        elif r < 0.8:
            out.append(rng.choice(ZWJ_SEQ))
        else:
            out.append(rng.choice(EMOJI_BASE))
        out.append(rng.choice(["", " ", "a", "!", "\n"]))
    return "".join(out)


def gen_combining(rng):
    out = []
    for _ in range(rng.randint(1, 8)):
        out.append(rng.choice("aeiouAEIOUnczZ "))
        out.append("".join(rng.choice(COMBINING) for _ in range(rng.randint(0, 5))))
    return "".join(out)


def gen_hangul(rng):
    return " ".join(rand_range(rng, 0xAC00, 0xD7A3, rng.randint(1, 6))
                    for _ in range(rng.randint(1, 5))) + rng.choice(["", "\u1100\u1161", "ㄱㄴ"])


def gen_devanagari(rng):
    return " ".join(rand_range(rng, 0x0900, 0x097F, rng.randint(1, 8))
                    for _ in range(rng.randint(1, 5))) + rng.choice(["", "।", " १२"])


def gen_unusual(rng):
    return "".join(rng.choice(UNUSUAL) + rng.choice(["", "a", " ", "1", "é"])
                   for _ in range(rng.randint(1, 8)))


def gen_special(rng):
    parts = []
    for _ in range(rng.randint(1, 6)):
        parts.append(rng.choice(SPECIALS))
        parts.append(rng.choice(["", "user", "\n", " hi ", "assistant\n", "x", "  "]))
    return "".join(parts)


GENERATORS = [gen_prose, gen_code, gen_whitespace, gen_numbers, gen_punct, gen_cjk, gen_arabic,
              gen_emoji, gen_combining, gen_hangul, gen_devanagari, gen_unusual, gen_special]


def build_corpus(n_per_kind=160, seed=20240509):
    rng = random.Random(seed)
    corpus = ["", " ", "\n", "a", "Hello world", " Hello", "I'm here", "'s", "   leading",
              "trailing   ", "\t\t\n\n  \r\n", "<|im_start|>user\nHi<|im_end|>\n"]
    for gen in GENERATORS:
        corpus += [gen(rng) for _ in range(n_per_kind)]
    for _ in range(160):  # mixtures of everything
        corpus.append("".join(rng.choice(GENERATORS)(rng) for _ in range(rng.randint(2, 5))))
    for _ in range(6):  # a few long strings
        corpus.append("".join(rng.choice(GENERATORS)(rng) for _ in range(120)))
    return corpus


# Invalid UTF-8 (bytes), passed to kvstack with surrogate escapes. (Not
# included: sequences decoding above U+10FFFF such as F4 90 80 80, on which
# llama.cpp aborts; kvstack reads each such byte as U+FFFD.)
INVALID = [b"\xff", b"abc\x80def", b"\xc3", b"\xe4\xb8", b"ok\xf0\x9f\x98", b"\xc0\x80",
           b"\xed\xa0\x80x", b"\xfe\xfe ok", b"caf\xe9 au lait", b"\x80\x80\xbf<|im_end|>",
           b"<start_of_turn>\xe4\xb8user\n\xff\xfe<end_of_turn>", b"  \xc3(\t\t<table>\x80"]


# ---------------------------------------------------------------- helpers

@pytest.fixture(scope="module")
def llama():
    if not os.path.exists(MODEL):
        pytest.skip(f"model not found: {MODEL}")
    return llama_cpp.Llama(model_path=MODEL, vocab_only=True, verbose=False)


def run_kvstack(args, lines):
    if not os.path.exists(BIN):
        pytest.fail(f"kvstack executable not found: {BIN} (set KVSTACK_BIN)")
    proc = subprocess.run([BIN] + args + ["-m", MODEL, "--jsonl"], input="\n".join(lines) + "\n",
                          capture_output=True, text=True, encoding="ascii", timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout.splitlines()
    assert len(out) == len(lines), (len(out), len(lines), proc.stderr)
    return [json.loads(x) for x in out]


def to_json_line(data: bytes) -> str:
    return json.dumps(data.decode("utf-8", "surrogateescape"), ensure_ascii=True)


def llama_detokenize(llama, ids, special):
    """The real llama_detokenize (the Python wrapper's per-token buffer is 32 bytes)."""
    vocab = llama._model.vocab
    arr = (llama_cpp.llama_token * max(1, len(ids)))(*ids)
    size = 64 + 16 * len(ids)
    while True:
        buf = ctypes.create_string_buffer(size)
        n = llama_cpp.llama_detokenize(vocab, arr, len(ids), buf, size, False, special)
        if n >= 0:
            return buf.raw[:n]
        size = -n + 16


def report(mismatches, what):
    if mismatches:
        lines = [f"{len(mismatches)} {what} mismatches; first ones:"]
        for m in mismatches[:8]:
            lines.append("  " + repr(m)[:400])
        pytest.fail("\n".join(lines))


# ------------------------------------------------------------------ tests

def test_corpus_is_large_and_deterministic():
    a, b = build_corpus(), build_corpus()
    assert a == b
    assert len(a) >= 2000


@pytest.mark.parametrize("special", [False, True], ids=["plain", "parse_special"])
def test_tokenize_matches_llama_cpp(llama, special):
    corpus = [s.encode("utf-8") for s in build_corpus()] + INVALID
    args = ["tokenize"] + (["--special"] if special else [])
    ours = run_kvstack(args, [to_json_line(b) for b in corpus])
    mismatches = []
    for data, got in zip(corpus, ours):
        want = llama.tokenize(data, add_bos=True, special=special)
        if got != want:
            mismatches.append((data, got, want))
    report(mismatches, "tokenize")


def test_tokenize_without_bos_matches(llama):
    corpus = [s.encode("utf-8") for s in build_corpus()[:300]]
    ours = run_kvstack(["tokenize", "--no-bos"], [to_json_line(b) for b in corpus])
    mismatches = [(d, g) for d, g in zip(corpus, ours)
                  if g != llama.tokenize(d, add_bos=False, special=False)]
    report(mismatches, "tokenize --no-bos")


@pytest.mark.parametrize("special", [False, True], ids=["plain", "render_special"])
def test_detokenize_round_trips_and_matches(llama, special):
    corpus = build_corpus()
    id_lists = [llama.tokenize(s.encode("utf-8"), add_bos=True, special=special) for s in corpus]
    adds_bos = bool(llama_cpp.llama_vocab_get_add_bos(llama._model.vocab))
    args = ["detokenize"] + (["--special"] if special else [])
    ours = run_kvstack(args, [json.dumps(ids) for ids in id_lists])
    mismatches, round_trip = [], []
    for s, ids, got in zip(corpus, id_lists, ours):
        got_bytes = got.encode("utf-8", "surrogateescape")
        want = llama_detokenize(llama, ids, special)
        if got_bytes != want:
            mismatches.append((s, ids, got_bytes, want))
        # With special parsing off, control-token text is tokenized as plain
        # text, so the text always comes back; with it on, only when rendered
        # (after the rendered BOS when the vocab adds one, as Gemma's does).
        expect = s.encode("utf-8")
        if special and adds_bos:
            expect = llama_detokenize(llama, ids[:1], True) + expect
        if got_bytes != expect:
            round_trip.append((s, got_bytes))
    report(mismatches, "detokenize")
    report(round_trip, "round-trip")


def test_cli_errors():
    if "SmolLM2" not in os.path.basename(MODEL):
        pytest.skip("the ids below are SmolLM2's")
    if not os.path.exists(BIN):
        pytest.fail(f"kvstack executable not found: {BIN}")
    bad_model = subprocess.run([BIN, "tokenize", "-m", "/nonexistent.gguf", "-p", "x"],
                               capture_output=True, text=True)
    assert bad_model.returncode != 0 and "/nonexistent.gguf" in bad_model.stderr
    bad_id = subprocess.run([BIN, "detokenize", "-m", MODEL, "--tokens", "1,2,49152"],
                            capture_output=True, text=True)
    assert bad_id.returncode != 0 and "49152" in bad_id.stderr
    ok = subprocess.run([BIN, "detokenize", "-m", MODEL, "--tokens", "[19556, 905]"],
                        capture_output=True, text=True)
    assert ok.returncode == 0 and ok.stdout == "Hello world\n"
    ids = subprocess.run([BIN, "tokenize", "-m", MODEL, "-p", "Hello world"],
                         capture_output=True, text=True)
    assert ids.returncode == 0 and json.loads(ids.stdout) == [19556, 905]
