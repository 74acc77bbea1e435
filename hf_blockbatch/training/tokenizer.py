"""A small byte-level BPE tokenizer for the tiny LLaDA- and Dream-style models.

Why train our own: the real LLaDA / Dream vocabularies have ~126k / ~152k entries; a tiny
model (d=128) would spend most of its parameters on embeddings and see each token rarely. A
vocabulary of ~1k, learned on the synthetic suites plus some general English, Python and maths
text, keeps the embedding small while real GSM8K / HumanEval prompts still encode (byte-level:
anything encodes, rare words just take more tokens).

Design choices:

* **Digits are single tokens.** The pre-tokenizer isolates every digit, so ``17`` is ``1`` ``7``
  everywhere and arithmetic is a per-digit fact the model can learn. A space *before* a digit
  is attached to the preceding word or operator (``" = "`` ``"7"``), not to the digit and not on
  its own, so each digit has exactly one token and numbers cost no extra space tokens.
* **Same merges, two families.** Both flavours share one trained BPE model; only the names of
  the special tokens at ids 0..7 differ. Ids are aligned by role (eos = pad = 0, bos = 1,
  mask = 2, end of turn = 3), so model configs and decoders can use the same constants.
* **Chat templates in each family's official style** (LLaDA-8B-Instruct: Llama-3 headers with a
  leading bos; Dream-v0-Instruct: Qwen ``<|im_start|>`` turns), so the prompt code path is the
  one used with the real models.
* **Deterministic**: the corpus comes from the seeded suites and fixed text below; the same
  ``seed`` writes byte-identical files.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

from hf_blockbatch.generation.outputs import END_OF_TURN_TOKENS

logger = logging.getLogger(__name__)

FAMILIES: tuple[str, ...] = ("llada", "dream")

#: number of reserved special-token ids at the bottom of the vocabulary
NUM_SPECIAL = 8
EOS_ID = 0
PAD_ID = 0
BOS_ID = 1
MASK_ID = 2
EOT_ID = 3

#: special tokens per family, in id order (0..NUM_SPECIAL-1); unused slots are reserved
SPECIAL_TOKENS: dict[str, tuple[str, ...]] = {
    "llada": (
        "<|endoftext|>",  # 0 eos = pad
        "<|startoftext|>",  # 1 bos
        "<|mdm_mask|>",  # 2 mask
        "<|eot_id|>",  # 3 end of turn
        "<|start_header_id|>",  # 4
        "<|end_header_id|>",  # 5
        "<|reserved_special_0|>",  # 6
        "<|reserved_special_1|>",  # 7
    ),
    "dream": (
        "<|endoftext|>",  # 0 eos = pad
        "<|beginoftext|>",  # 1 bos
        "<|mask|>",  # 2 mask
        "<|im_end|>",  # 3 end of turn
        "<|im_start|>",  # 4
        "<|reserved_special_0|>",  # 5
        "<|reserved_special_1|>",  # 6
        "<|reserved_special_2|>",  # 7
    ),
}

#: Jinja chat templates (our own, in the style of each family's official template)
CHAT_TEMPLATES: dict[str, str] = {
    # LLaDA-8B-Instruct: bos, then Llama-3 style turns; the content is trimmed, as there
    "llada": (
        "{{- bos_token -}}"
        "{%- for message in messages -%}"
        "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + (message['content'] | trim)"
        " + '<|eot_id|>' -}}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}{%- endif -%}"
    ),
    # Dream-v0-Instruct (Qwen2.5 style), without Qwen's default system turn: it would add ~10
    # tokens to every prompt of a model whose context is short; pass a system message to get one
    "dream": (
        "{%- for message in messages -%}"
        "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
    ),
}

DEFAULT_VOCAB_SIZE = 1024
#: the tiny models' context (positions): the tokenizers' ``model_max_length``, so ``truncation=True`` stops there
TINY_CONTEXT = 512
#: training items per suite in the BPE corpus
DEFAULT_PER_SUITE = 4000
#: where the shipped tokenizers live (``tiny-llada/``, ``tiny-dream/``)
ASSETS_DIR = Path(__file__).resolve().parent.parent / "assets"

# Pre-tokenization (GPT-2-like, see the module docstring for the digit rule):
# contractions | words with a leading space (+ one trailing space if a digit follows) | one digit
# | punctuation runs with a leading space (+ one trailing space if a digit follows) | whitespace
PRETOKENIZE_PATTERN = (
    r"'(?:[sdmt]|ll|ve|re)"
    r"| ?\p{L}+(?: (?=\p{N}))?"
    r"|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+(?: (?=\p{N}))?"
    r"|\s+(?!\S)"
    r"|\s+"
)

_PLACEHOLDERS = tuple(f"<|special_{i}|>" for i in range(NUM_SPECIAL))

# General text so that real benchmark prompts (GSM8K, MATH, HumanEval, MBPP) encode into
# sensible pieces, not only the suites' template words. Written for this project.
GENERAL_TEXT = r'''
A farmer has 24 cows and sells a third of them at the market. How many cows does the farmer have left?
The farmer sells 24 / 3 = 8 cows, so 24 - 8 = 16 cows are left.
#### 16
Maria earns $15 per hour and works 6 hours a day, five days a week. How much money does she earn in a week?
She earns 15 * 6 = $90 per day and 90 * 5 = $450 per week.
#### 450
A train travels 120 miles in 2 hours. What is its average speed in miles per hour?
The speed is 120 / 2 = 60 miles per hour.
A store offers a 20% discount on a jacket that costs $80. What is the price after the discount?
The discount is 80 * 0.2 = $16, so the price is 80 - 16 = $64.
John bought three dozen eggs for the bakery. Each dozen cost $2.50, and he paid with a twenty dollar bill.
The school has 450 students, and each classroom holds 30 of them. There are 15 classrooms in total.
She spent half of her savings on a bicycle and a quarter of the rest on books, then gave the remainder to her sister.
It takes 45 minutes to bake one tray of muffins, and the oven holds two trays at a time.
If the temperature drops 3 degrees every hour, how many degrees will it drop in 7 hours?
Every week, the family eats 14 apples, 6 bananas and 2 pineapples. What is the total number of fruits eaten in a year?
James runs 3 sprints 3 times a week. He runs 60 meters each sprint. How many total meters does he run a week?
The recipe needs 2 cups of flour for every 3 cups of sugar. Each of the children received an equal share of the candy.
Let x be the number of tickets sold on Monday. Then the number sold on Tuesday is 2x + 5, and the total is 3x + 5 = 50, so x = 15.
Find the value of $x$ such that $2x + 3 = 11$. Subtracting 3 from both sides gives $2x = 8$, so $x = \boxed{4}$.
What is the greatest common divisor of 48 and 180? Simplify $\frac{3}{4} + \frac{1}{6}$. Compute $\sqrt{144}$.
The area of a circle with radius $r$ is $\pi r^2$, and the perimeter of a rectangle is $2(l + w)$.
If $f(x) = x^2 - 4x + 4$, then $f(x) = (x - 2)^2$ and the minimum value is $0$.
The probability of rolling a sum of 7 with two dice is $\frac{6}{36} = \frac{1}{6}$.
Final Answer: The final answer is $12$. I hope it is correct.
The answer is 42. Therefore, the total cost is 1,250 dollars, or about 1.25 thousand.
Write a function to find the minimum of three numbers. Write a python function to count the number of vowels in a string.
Write a function to check whether the given number is a prime number or not.
Your code should pass these tests:
assert remove_duplicates([1, 2, 2, 3]) == [1, 2, 3]
assert is_palindrome("level") == True
from typing import List, Optional, Tuple, Dict


def has_close_elements(numbers: List[float], threshold: float) -> bool:
    """ Check if in given list of numbers, are any two numbers closer to each other than
    given threshold.
    >>> has_close_elements([1.0, 2.0, 3.0], 0.5)
    False
    """
    for idx, elem in enumerate(numbers):
        for idx2, elem2 in enumerate(numbers):
            if idx != idx2:
                distance = abs(elem - elem2)
                if distance < threshold:
                    return True
    return False


def count_words(text: str) -> Dict[str, int]:
    """Return a dictionary that maps each word to the number of times it appears."""
    counts = {}
    for word in text.lower().split():
        counts[word] = counts.get(word, 0) + 1
    return counts


class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        if not self.items:
            raise IndexError("pop from empty stack")
        return self.items.pop()


def fibonacci(n):
    a, b = 0, 1
    while n > 0:
        a, b = b, a + b
        n -= 1
    return a


import math
result = [x ** 2 for x in range(10) if x % 2 == 0]
print(sorted(result, reverse=True), max(result), min(result), sum(result) / len(result))
try:
    value = int(input())
except ValueError:
    value = None
else:
    value = math.sqrt(value)
finally:
    pass
with open("data.txt") as f:
    lines = [line.strip() for line in f]
text = ", ".join(str(v) for v in lines).replace("a", "b").startswith("x")
pairs = dict(zip(keys, values)); items = list(filter(lambda t: t[1] is not None, pairs.items()))
The quick brown fox jumps over the lazy dog. She said that they would come back tomorrow morning.
People often ask how long it takes to learn something new; the answer depends on practice, not only on time.
Because the weather was cold, the children stayed inside and played games, read stories, and drew pictures.
Each of these examples shows why it is important to check your work and explain every step clearly.
Question: What is the first step? Answer: First, we find the number of items; then we compute the total.
'''


def _corpus(seed: int, per_suite: int) -> list[str]:
    """Training text for the BPE: suite items (seeded) plus the general text, repeated."""
    from hf_blockbatch.tasks import SUITES, get_suite

    texts: list[str] = []
    for name in SUITES:
        for item in get_suite(name).train_items(per_suite, seed=seed):
            texts.append(item.question)
            texts.append(item.target or "")
    # weight the general text up, so its words get merges despite the suites' repetition
    texts.extend([GENERAL_TEXT] * 40)
    return texts


def _train_bpe(vocab_size: int, seed: int, per_suite: int) -> dict[str, Any]:
    """Train the shared BPE model; returns the tokenizer as JSON with placeholder specials."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    from hf_blockbatch.checks import check_positive_int

    # the byte alphabet and the specials are always in the vocabulary: a smaller size gave a tokenizer of another
    # size than asked for (100 -> 264 tokens) without a word, and a negative one an OverflowError from the trainer
    check_positive_int("vocab_size", vocab_size)
    least = len(pre_tokenizers.ByteLevel.alphabet()) + NUM_SPECIAL
    if vocab_size < least:
        raise ValueError(f"vocab_size must be at least {least} (the {least - NUM_SPECIAL} byte symbols and the "
                         f"{NUM_SPECIAL} special tokens are always in the vocabulary), got {vocab_size}.")  # fmt: skip
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(_PLACEHOLDERS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed, per_suite), trainer=trainer)
    return json.loads(tok.to_str())


def _rename_specials(spec: dict[str, Any], family: str) -> dict[str, Any]:
    """The shared model with this family's special-token names at ids 0..NUM_SPECIAL-1."""
    spec = json.loads(json.dumps(spec))  # deep copy
    names = dict(zip(_PLACEHOLDERS, SPECIAL_TOKENS[family]))
    for added in spec["added_tokens"]:
        added["content"] = names[added["content"]]
    vocab = spec["model"]["vocab"]
    spec["model"]["vocab"] = {names.get(k, k): v for k, v in vocab.items()}
    for i, placeholder in enumerate(_PLACEHOLDERS):
        assert vocab[placeholder] == i, "special tokens must sit at ids 0..NUM_SPECIAL-1"
    return spec


def _wrap(spec: dict[str, Any], family: str) -> Any:
    """A ``PreTrainedTokenizerFast`` with the family's roles and chat template."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    specials = SPECIAL_TOKENS[family]
    fast = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
        eos_token=specials[EOS_ID],
        pad_token=specials[PAD_ID],
        bos_token=specials[BOS_ID],
        mask_token=specials[MASK_ID],
        additional_special_tokens=[t for i, t in enumerate(specials) if i not in (EOS_ID, BOS_ID, MASK_ID)],
        model_max_length=TINY_CONTEXT,
        # diffusion decoders append the masked canvas after the prompt: batches are left-padded
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATES[family]
    return fast


def train_tokenizer(
    out_dir: str | Path | None,
    family: str,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    seed: int = 0,
    per_suite: int = DEFAULT_PER_SUITE,
) -> Any:
    """Train the shared BPE and return (and, when ``out_dir`` is given, save) one family's tokenizer.

    Writes ``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json`` (and
    whatever else ``save_pretrained`` writes), loadable offline with
    ``AutoTokenizer.from_pretrained(out_dir)``.
    """
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    fast = _wrap(_rename_specials(_train_bpe(vocab_size, seed, per_suite), family), family)
    if out_dir is not None:
        save_tokenizer(fast, out_dir, family)
    return fast


def save_tokenizer(fast: Any, out_dir: str | Path, family: str) -> None:
    """``save_pretrained`` plus an explicit ``special_tokens_map.json`` and the template in the config.

    Why write those two ourselves: transformers 5 keeps the chat template in a separate
    ``chat_template.jinja`` and no longer writes ``special_tokens_map.json``; older readers
    (and people reading the folder) look for both.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
    specials = SPECIAL_TOKENS[family]
    smap = {
        "bos_token": specials[BOS_ID],
        "eos_token": specials[EOS_ID],
        "pad_token": specials[PAD_ID],
        "mask_token": specials[MASK_ID],
        "additional_special_tokens": [
            t for i, t in enumerate(specials) if i not in (EOS_ID, BOS_ID, MASK_ID)
        ],
    }
    (out / "special_tokens_map.json").write_text(json.dumps(smap, indent=2) + "\n")
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = CHAT_TEMPLATES[family]
    # the portable class name: transformers 5 maps it to its tokenizers backend, 4.x loads it too
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def asset_dir(family: str) -> Path:
    """Folder of the shipped tokenizer (and, once trained, the tiny model) of ``family``."""
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    return ASSETS_DIR / f"tiny-{family}"


def load_tokenizer(family: str) -> Any:
    """The shipped tokenizer of ``family``, loaded offline with ``AutoTokenizer``."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(asset_dir(family)))


def write_assets(vocab_size: int = DEFAULT_VOCAB_SIZE, seed: int = 0) -> list[Path]:
    """(Re)write both families' tokenizers into the package assets (one BPE training)."""
    spec = _train_bpe(vocab_size, seed, DEFAULT_PER_SUITE)
    out = []
    for family in FAMILIES:
        save_tokenizer(_wrap(_rename_specials(spec, family), family), asset_dir(family), family)
        out.append(asset_dir(family))
    return out


def special_token_ids(tokenizer: Any) -> dict[str, int]:
    """Ids of the roles decoders need: ``mask``, ``eos``, ``pad``, ``bos``, ``eot`` (end of turn).

    Works for the tiny tokenizers and for the real LLaDA / Dream ones (looked up by name, so
    it does not assume our fixed ids).
    """
    vocab = tokenizer.get_vocab()
    mask = next((t for t in ("<|mdm_mask|>", "<|mask|>") if t in vocab), tokenizer.mask_token)
    eot = next((t for t in END_OF_TURN_TOKENS if t in vocab), tokenizer.eos_token)
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id
    return {
        "mask": vocab[mask],
        "eos": eos,
        "pad": eos if pad is None else pad,
        "bos": tokenizer.bos_token_id,
        "eot": vocab[eot],
    }


def main(argv: list[str] | None = None) -> None:
    """CLI: ``python -m hf_blockbatch.training.tokenizer --out DIR --family llada``."""
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--out", help="output folder (with --family)")
    p.add_argument("--family", choices=FAMILIES)
    p.add_argument("--assets", action="store_true", help="rewrite both tokenizers in hf_blockbatch/assets/")
    p.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.assets:
        for path in write_assets(vocab_size=args.vocab_size, seed=args.seed):
            print(f"wrote {path}")
        return
    if not (args.out and args.family):
        p.error("--out and --family are required (or use --assets)")
    tok = train_tokenizer(args.out, args.family, vocab_size=args.vocab_size, seed=args.seed)
    print(f"wrote {args.family} tokenizer ({len(tok)} tokens) to {args.out}")


if __name__ == "__main__":
    from hf_blockbatch.eval.script_args import run_main

    raise SystemExit(run_main(main))
