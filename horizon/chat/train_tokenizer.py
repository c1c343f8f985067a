"""Train the bundled tokenizer: byte-level BPE, exactly 4096 ids including the special tokens.

The training text is generated here from a fixed seed (nothing is downloaded, nothing read from
disk), so the same code always produces the same ``tokenizer.json``:

    python -m horizon.chat.train_tokenizer            # writes horizon/chat/assets/tokenizer.json
    python -m horizon.chat.train_tokenizer --check    # exit 1 if the bundled file differs

The text mixes what a tool-using agent reads and writes: English-like prose, numbers and
arithmetic, JSON (tool calls, tool schemas, results), Python / shell / Markdown, and words in other
scripts (CJK, Cyrillic, Greek, Arabic, Devanagari, accented Latin, emoji). A tiny model trained on
this vocabulary is a test vehicle; real checkpoints ship their own tokenizer.json.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from horizon.chat.tokenizer import BUNDLED_TOKENIZER, SPECIAL_TOKENS

VOCAB_SIZE = 4096
SEED = 20250101
NUM_DOCUMENTS = 24_000

# The GPT-4 / Llama-3 split (letters with one leading non-letter, punctuation runs, newlines kept apart
# from spaces), except that every digit stands alone: a 4096-id vocabulary should not spend a
# quarter of its ids on numbers, and single digits keep arithmetic regular for a small model.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

WORDS = """
the of and to a in is it you that he was for on are with as his they be at one have this from or had
by not word but what some we can out other were all there when up use your how said an each she which
do their time if will way about many then them write would like so these her long make thing see him two
has look more day could go come did number sound no most people my over know water than call first who
may down side been now find any new work part take get place made live where after back little only
round man year came show every good me give our under name very through just form sentence great think
say help low line differ turn cause much mean before move right boy old too same tell does set three
want air well also play small end put home read hand port large spell add even land here must big high
such follow act why ask men change went light kind off need house picture try us again animal point
mother world near build self earth father head stand own page should country found answer school grow
study still learn plant cover food sun four between state keep eye never last let thought city tree
cross farm hard start might story saw far sea draw left late run while press close night real life few
north open seem together next white children begin got walk example ease paper group always music those
both mark often letter until mile river car feet care second book carry took science eat room friend
began idea fish mountain stop once base hear horse cut sure watch color face wood main enough plain girl
usual young ready above ever red list though feel talk bird soon body dog family direct pose leave song
measure door product black short numeral class wind question happen complete ship area half rock order
fire south problem piece told knew pass since top whole king space heard best hour better true during
hundred five remember step early hold west ground interest reach fast verb sing listen six table travel
less morning ten simple several vowel toward war lay against pattern slow center love person money serve
appear road map rain rule govern pull cold notice voice unit power town fine certain fly fall lead cry
dark machine note wait plan figure star box noun field rest correct able pound done beauty drive stood
contain front teach week final gave green quick develop ocean warm free minute strong special mind behind
clear tail produce fact street inch multiply nothing course stay wheel full force blue object decide
surface deep moon island foot system busy test record boat common gold possible plane instead dry wonder
laugh thousand ago ran check game shape equate miss brought heat snow tire bring yes distant fill east
paint language among model agent tool call result error request response server client token context
memory cache layer attention expert router weight tensor batch file repository branch commit merge test
build deploy config value string integer float boolean array object null true false function method
class module package import return yield async await lambda thread process queue budget thinking reason
answer search query weather temperature city country date price stock report document spreadsheet
summary analysis data database table column row index schema field user assistant system message
history turn input output stream parse format encode decode image text code terminal command shell
""".split()

NAMES = """
Alice Bob Carol Dave Erin Frank Grace Heidi Ivan Judy Mallory Niaj Olivia Peggy Rupert Sybil Trent
Victor Walter Beijing Paris London Tokyo Berlin Madrid Rome Cairo Lagos Lima Sydney Toronto Seoul
Mumbai Moscow Istanbul Nairobi Oslo Vienna Prague Dublin Lisbon Athens Chicago Boston Denver Austin
Monday Tuesday Wednesday Thursday Friday Saturday Sunday January February March April June July
August September October November December Python Rust JavaScript Linux GitHub Horizon OpenAI
""".split()

VERBS = "get set list create update delete search fetch read write run find send open close compute".split()

# Characters of other scripts; words are drawn from these with the same seeded generator.
CJK = (
    "的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年得就那要下以生会自着去之过家学对可她里"
    "后小么心多天而能好都然没日于起还发成事只作当想看文无开手十用主行方又如前所本见经头面公同三已老从动两长"
    "知民样现分将外但身些与高意进把法此实回二理美点月明其种声全工己话儿者向情部正名定女问力机给等几很业最间"
    "新什打便位因重被走电四第门相次东政海口使教西再平真听世气信北少关并内加化由却代军产入先山五太水万市眼体"
    "别处总才场师书比住员九笑性通目华报立马命张活难神数件安表原车白应路期叫死常提感金何更反合放做系计或司利"
    "你好世界模型工具调用结果思考回答问题天气城市温度文件代码测试请帮助谢谢"
)
KANA = [chr(c) for c in range(0x3041, 0x3097)] + [chr(c) for c in range(0x30A1, 0x30FB)]
HANGUL = (
    "가나다라마바사아자차카타파하고노도로모보소오조초코토포호는을를이가에서와과한국어안녕하세요감사합니다"
)
CYRILLIC = [chr(c) for c in range(0x0430, 0x0450)]
GREEK = [chr(c) for c in range(0x03B1, 0x03CA)]
ARABIC = [chr(c) for c in range(0x0627, 0x064B)]
DEVANAGARI = [chr(c) for c in range(0x0905, 0x0939)]
ACCENTED = (
    "café naïve Müller São Paulo Zürich déjà vu façade jalapeño crème brûlée Ångström Þór Łódź Dvořák".split()
)
EMOJI = [
    chr(c) for c in (*range(0x1F600, 0x1F640), *range(0x1F300, 0x1F320), 0x2705, 0x274C, 0x2764, 0x1F680)
]
SYMBOLS = "→ ← ↑ ↓ ≤ ≥ ≠ ± × ÷ ° µ € £ ¥ © ® ™ • … — – “ ” ‘ ’ « » ∑ ∫ √ ∞ π λ".split()


def _word(rng: random.Random) -> str:
    return rng.choice(WORDS) if rng.random() < 0.92 else rng.choice(NAMES)


def _ident(rng: random.Random) -> str:
    return "_".join(rng.choice(WORDS) for _ in range(rng.randint(1, 3)))


def _number(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.5:
        return str(rng.randint(0, 10 ** rng.randint(1, 6)))
    if kind < 0.8:
        return f"{rng.uniform(-1000, 1000):.{rng.randint(1, 4)}f}"
    return f"{rng.uniform(0, 1):.3g}e{rng.randint(-9, 9)}"


def prose(rng: random.Random) -> str:
    sentences = []
    for _ in range(rng.randint(2, 9)):
        words = [_word(rng) for _ in range(rng.randint(4, 18))]
        if rng.random() < 0.2:
            words.insert(rng.randrange(len(words)), _number(rng))
        if rng.random() < 0.25:
            i = rng.randrange(len(words))
            words[i] += ","
        if rng.random() < 0.1:
            words[rng.randrange(len(words))] = rng.choice(
                ["don't", "it's", "we're", "they've", "I'll", "can't"]
            )
        if rng.random() < 0.1:
            words[rng.randrange(len(words))] = f'"{_word(rng)}"'
        words[0] = words[0].capitalize()
        sentences.append(" ".join(words) + rng.choice([".", ".", ".", "?", "!", ":", ";"]))
    sep = "\n\n" if rng.random() < 0.3 else " "
    return sep.join(sentences)


def arithmetic(rng: random.Random) -> str:
    lines = []
    for _ in range(rng.randint(2, 8)):
        a, b = rng.randint(0, 99999), rng.randint(1, 9999)
        op = rng.choice("+-*/")
        value = {"+": a + b, "-": a - b, "*": a * b, "/": round(a / b, 4)}[op]
        lines.append(
            rng.choice([f"{a} {op} {b} = {value}", f"{a}{op}{b}={value}", f"({a} {op} {b}) = {value}"])
        )
    extras = [
        f"{rng.randint(1990, 2035)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}",
        f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}:{rng.randint(0, 59):02d}",
        f"${rng.randint(1, 99999):,}.{rng.randint(0, 99):02d}",
        f"{rng.uniform(0, 100):.1f}%",
        f"x = {_number(rng)}, y = {_number(rng)}",
    ]
    lines.append(" ".join(rng.sample(extras, 3)))
    return "\n".join(lines)


def _json_value(rng: random.Random, depth: int = 0):
    kind = rng.random()
    if depth < 3 and kind < 0.2:
        return {_ident(rng): _json_value(rng, depth + 1) for _ in range(rng.randint(1, 5))}
    if depth < 3 and kind < 0.3:
        return [_json_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    if kind < 0.55:
        return " ".join(_word(rng) for _ in range(rng.randint(1, 6)))
    if kind < 0.65:
        return _foreign(rng)
    if kind < 0.85:
        return rng.choice([rng.randint(-1000, 100000), round(rng.uniform(-100, 100), 3)])
    return rng.choice([True, False, None])


def json_text(rng: random.Random) -> str:
    obj = {_ident(rng): _json_value(rng) for _ in range(rng.randint(1, 6))}
    style = rng.random()
    if style < 0.4:
        return json.dumps(obj, ensure_ascii=False)
    if style < 0.6:
        return json.dumps(obj, separators=(",", ":"), ensure_ascii=rng.random() < 0.3)
    return json.dumps(obj, indent=rng.choice([2, 4]), ensure_ascii=False)


def tool_payload(rng: random.Random) -> str:
    name = f"{rng.choice(VERBS)}_{rng.choice(WORDS)}"
    args = {_ident(rng): _json_value(rng, 2) for _ in range(rng.randint(0, 4))}
    kind = rng.random()
    if kind < 0.5:  # the exact form the chat template renders a tool call in
        return json.dumps({"name": name, "arguments": args}, ensure_ascii=False)
    if kind < 0.8:  # a tool definition (OpenAI function shape)
        props = {
            k: {
                "type": rng.choice(["string", "integer", "number", "boolean", "array", "object"]),
                "description": prose(rng)[:60],
            }
            for k in args or {_ident(rng): None}
        }
        fn = {
            "name": name,
            "description": prose(rng)[:120],
            "parameters": {"type": "object", "properties": props, "required": list(props)[:1]},
        }
        return json.dumps(fn, ensure_ascii=False)
    return json.dumps({"status": rng.choice(["ok", "error"]), "result": _json_value(rng)}, ensure_ascii=False)


def python_code(rng: random.Random) -> str:
    fn, args = _ident(rng), [_ident(rng) for _ in range(rng.randint(0, 3))]
    body = []
    for _ in range(rng.randint(1, 6)):
        var = _ident(rng)
        body.append(
            rng.choice(
                [
                    f"    {var} = {rng.choice(args or ['None'])}",
                    f"    {var} = {_ident(rng)}({', '.join(args)})",
                    f"    for {var} in range({rng.randint(1, 100)}):\n"
                    f"        total += {var} * {rng.randint(2, 9)}",
                    f"    if {var} is None:\n"
                    f'        raise ValueError(f"{_word(rng)} {{{var}!r}} is not allowed")',
                    f"    {var}: list[int] = [x ** 2 for x in {_ident(rng)} if x % 2 == 0]",
                    f"    # {prose(rng)[:70]}",
                    f'    print("{_word(rng)}", {var})',
                ]
            )
        )
    body.append(f"    return {rng.choice(args or ['None', '0', 'True'])}")
    head = rng.choice(
        [
            "",
            f"import {_ident(rng)}\nfrom {_ident(rng)} import {_ident(rng)}\n\n\n",
            f"class {''.join(w.capitalize() for w in _ident(rng).split('_'))}:\n",
        ]
    )
    indent = "    " if head.startswith("class") else ""
    lines = [f"def {fn}({', '.join(args)}):", f'    """{prose(rng)[:80]}"""', *body]
    return head + "\n".join(indent + line for line in lines) + "\n"


def shell_and_markdown(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.4:
        cmds = [
            f'git commit -m "{prose(rng)[:40]}"',
            f"cd {_ident(rng)}/{_ident(rng)} && ls -la",
            f'grep -rn "{_word(rng)}" src/ | head -n {rng.randint(1, 50)}',
            f"python -m pytest tests/{_ident(rng)}.py -q",
            f"curl -s http://localhost:{rng.randint(1000, 9999)}/v1/chat/completions",
            f"pip install {_word(rng)}=={rng.randint(0, 9)}.{rng.randint(0, 20)}",
            f"echo $HOME; export {_ident(rng).upper()}={_number(rng)}",
        ]
        return "\n".join("$ " + c for c in rng.sample(cmds, rng.randint(1, 4)))
    if kind < 0.7:
        rows = [f"| {_word(rng)} | {_number(rng)} | {_word(rng)} |" for _ in range(rng.randint(1, 5))]
        return f"## {prose(rng)[:30]}\n\n| name | value | note |\n|---|---|---|\n" + "\n".join(rows)
    items = [
        f"{rng.choice(['-', '*', '1.'])} **{_word(rng)}**: {prose(rng)[:60]}"
        for _ in range(rng.randint(2, 5))
    ]
    return f"# {_word(rng).capitalize()}\n\n" + "\n".join(items) + f"\n\n```python\n{python_code(rng)}```"


def _foreign(rng: random.Random) -> str:
    script = rng.random()
    if script < 0.35:
        return "".join(rng.choice(CJK) for _ in range(rng.randint(2, 12)))
    if script < 0.45:
        return "".join(rng.choice(KANA) for _ in range(rng.randint(2, 8)))
    if script < 0.52:
        return "".join(rng.choice(HANGUL) for _ in range(rng.randint(2, 6)))
    if script < 0.7:
        return "".join(rng.choice(CYRILLIC) for _ in range(rng.randint(2, 9)))
    if script < 0.77:
        return "".join(rng.choice(GREEK) for _ in range(rng.randint(2, 9)))
    if script < 0.83:
        return "".join(rng.choice(ARABIC) for _ in range(rng.randint(2, 7)))
    if script < 0.88:
        return "".join(rng.choice(DEVANAGARI) for _ in range(rng.randint(2, 7)))
    if script < 0.95:
        return rng.choice(ACCENTED)
    return rng.choice(EMOJI) * rng.randint(1, 2)


def multilingual(rng: random.Random) -> str:
    parts = []
    for _ in range(rng.randint(3, 15)):
        r = rng.random()
        parts.append(_foreign(rng) if r < 0.6 else rng.choice(SYMBOLS) if r < 0.7 else _word(rng))
    return " ".join(parts) + rng.choice(["。", "！", "？", ".", ""])


GENERATORS: list[tuple[float, Callable[[random.Random], str]]] = [
    (0.34, prose),
    (0.10, arithmetic),
    (0.12, json_text),
    (0.12, tool_payload),
    (0.14, python_code),
    (0.08, shell_and_markdown),
    (0.10, multilingual),
]


def corpus(seed: int = SEED, documents: int = NUM_DOCUMENTS) -> Iterator[str]:
    """The deterministic training text, one document at a time."""
    rng = random.Random(seed)
    weights = [w for w, _ in GENERATORS]
    for _ in range(documents):
        (gen,) = rng.choices([g for _, g in GENERATORS], weights=weights)
        yield gen(rng)


def train(texts: Iterator[str], vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """Byte-level BPE with the Horizon special tokens at ids 0.. and the 256 byte tokens after them."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS.values()),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte, so any text encodes
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    if tok.get_vocab_size() != vocab_size:
        raise ValueError(
            f"training gave {tok.get_vocab_size()} ids, wanted exactly {vocab_size}: add training text"
        )
    return tok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=BUNDLED_TOKENIZER, help="where to write tokenizer.json")
    parser.add_argument("--check", action="store_true", help="only compare with --out; exit 1 if different")
    args = parser.parse_args(argv)
    text = train(corpus()).to_str(pretty=True) + "\n"
    if args.check:
        same = args.out.is_file() and args.out.read_text(encoding="utf-8") == text
        print(f"{args.out}: {'up to date' if same else 'DIFFERS from what this script trains'}")
        return 0 if same else 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text, encoding="utf-8")
    print(f"wrote {args.out} ({VOCAB_SIZE} ids, {len(SPECIAL_TOKENS)} special)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
