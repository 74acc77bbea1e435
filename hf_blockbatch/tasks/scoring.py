"""Answer extraction and comparison for the number and math benchmarks (GSM8K, MATH).

Why this module exists: the accuracy column of the paper's table is only comparable if we read
answers out of completions the way lm-evaluation-harness does (GSM8K: the number after ``####``,
else the last number; MATH: minerva's "Final Answer: The final answer is $X$" or the last
``\\boxed{}``), and then compare them by *value*, not by string: ``\\frac{1}{2}``, ``0.5`` and
``1/2`` are the same answer. String equality would silently under-count correct completions and
make the decoders look worse than they are.

Nothing here executes untrusted code; code scoring lives in :mod:`hf_blockbatch.tasks.execution`.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Sequence
from fractions import Fraction

from hf_blockbatch.tasks.contract import Score

logger = logging.getLogger(__name__)

__all__ = [
    "extract_gsm8k_answer",
    "normalize_number",
    "numbers_equal",
    "gsm8k_is_correct",
    "last_boxed_only_string",
    "remove_boxed",
    "extract_math_answer",
    "normalize_math_answer",
    "math_is_equivalent",
    "math_is_correct",
    "truncate_at",
    "extract_code",
]

# --------------------------------------------------------------------------------------------
# shared helpers


def truncate_at(text: str, stops: tuple[str, ...] | list[str] | str) -> str:
    """Cut ``text`` at the earliest stop sequence (a string is one sequence, not its characters: iterated, "Question:"
    cut at its "n").

    Why: a base model prompted few-shot keeps going after its answer and writes the next
    "Question: ..." itself; lm-eval stops generation there (``until``), and a diffusion decoder
    with a fixed generation length cannot, so the scorer must cut instead, or the *last* number
    would come from an invented follow-up question.
    """
    cut = len(text)
    for stop in (stops,) if isinstance(stops, str) else stops:
        if not stop:
            continue
        i = text.find(stop)
        if 0 <= i < cut:
            cut = i
    return text[:cut]


# --------------------------------------------------------------------------------------------
# GSM8K

# A number: 1,234.5 style (commas only in thousands groups), plain 1234.5, or .5; optional sign.
_NUMBER_RE = re.compile(r"[-−]?(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)")
_HASH_RE = re.compile(r"####\s*(.*)", re.DOTALL)


def normalize_number(text: str) -> str | None:
    """Canonical string for a number: no ``$``/commas/trailing ``.``, ``7.0`` → ``7``.

    Why canonicalise rather than keep the raw token: gold answers are integers written plainly,
    while models write ``$1,200.00`` or ``7.``; both must map to one string so the extracted
    answer shown in reports is readable and comparable.
    """
    s = text.strip().replace("−", "-").replace("$", "").replace(",", "").strip()
    s = s.rstrip(".").strip()
    if not s:
        return None
    value = _fraction(s)
    if value is None:
        return s
    if value.denominator == 1:
        return str(value.numerator)
    # keep a short decimal form when it is exact (0.5, 2.25), else the fraction
    try:
        short = repr(float(value))
    except OverflowError:  # beyond a float (a run of digits from a decoder): the exact fraction
        short = ""
    if short and Fraction(short) == value:
        return short
    return f"{value.numerator}/{value.denominator}"


def numbers_equal(a: str | None, b: str | None) -> bool:
    """Equality of two number strings by exact value (``7.00`` equals ``7``; ``1450001`` does not equal
    ``1450000``, which a float tolerance let through), falling back to string equality for what is no number."""
    if a is None or b is None:
        return False
    na, nb = normalize_number(a), normalize_number(b)
    if na is None or nb is None:
        return False
    fa, fb = _fraction(na), _fraction(nb)
    return fa == fb if fa is not None and fb is not None else na == nb  # not a number: as written


_EXPONENT_RE = re.compile(r"[eE]([+-]?\d+)$")
#: an exponent beyond any float's: ``Fraction("1e99999999")`` builds the integer exactly, which takes minutes
_MAX_EXPONENT = 400


def _fraction(s: str) -> Fraction | None:
    """``s`` as an exact rational, or None where it is no number, or past the digit limit or the exponent bound."""
    exponent = _EXPONENT_RE.search(s)
    try:
        if exponent and abs(int(exponent.group(1))) > _MAX_EXPONENT:
            return None
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def extract_gsm8k_answer(text: str) -> str | None:
    """The answer of a GSM8K-style response, normalised (``"1,200.00"`` → ``"1200"``).

    The number after the *last* ``####`` when there is one (lm-eval's "strict-match", the
    format of the gold answers and of the few-shot targets); otherwise the last number in the
    text (lm-eval's "flexible-extract"), which rescues chat models that answer in prose.
    Returns ``None`` when the text holds no number at all.
    """
    if not text:
        return None
    if "####" in text:
        tail = text[text.rfind("####") + 4 :]
        m = _NUMBER_RE.search(tail)
        # "#### $18" / "#### 18." / "####18": the first number right after the marker
        if m is not None and not tail[: m.start()].strip(" \t$*:"):
            return normalize_number(m.group(0))
    numbers = _NUMBER_RE.findall(text)
    if not numbers:
        return None
    return normalize_number(numbers[-1])


def gsm8k_is_correct(completion: str, gold_answer_text: str) -> Score:
    """Score a GSM8K completion against the gold answer (full ``... #### N`` text, or just ``N``)."""
    gold = extract_gsm8k_answer(gold_answer_text)
    pred = extract_gsm8k_answer(completion)
    correct = pred is not None and gold is not None and numbers_equal(pred, gold)
    return Score(correct=correct, extracted=pred, detail=f"gold={gold}")


# --------------------------------------------------------------------------------------------
# MATH: extraction


def last_boxed_only_string(text: str) -> str | None:
    """The last ``\\boxed{...}`` (or ``\\fbox{...}``, or ``\\boxed 5``) in ``text``, braces matched.

    Why brace matching instead of a regex: boxed answers nest braces (``\\boxed{\\frac{1}{2}}``),
    which no regular expression balances.
    """
    if not text:
        return None
    idx = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if idx < 0:
        return None
    cmd = "\\boxed" if text.startswith("\\boxed", idx) else "\\fbox"
    after = idx + len(cmd)
    if text.startswith(" ", after) and not text[after:].lstrip().startswith("{"):
        # "\boxed 5" form: the token up to whitespace or "$"
        m = re.match(r"\s+([^\s$]+)", text[after:])
        return None if m is None else cmd + " " + m.group(1)
    i = after
    while i < len(text) and text[i].isspace():
        i += 1
    if i >= len(text) or text[i] != "{":
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return cmd + text[i : j + 1]
    return None  # unbalanced: the box was cut off by the generation length


def remove_boxed(boxed: str | None) -> str | None:
    """The content of a ``\\boxed{...}`` string from :func:`last_boxed_only_string`."""
    if boxed is None:
        return None
    for cmd in ("\\boxed", "\\fbox"):
        if boxed.startswith(cmd + " "):
            return boxed[len(cmd) + 1 :].strip()
        if boxed.startswith(cmd):
            rest = boxed[len(cmd) :].strip()
            if rest.startswith("{") and rest.endswith("}"):
                return rest[1:-1].strip()
    return None


_FINAL_ANSWER_RES = (
    # minerva's exact target format (the few-shot examples end this way)
    # (the answer never spans another "final answer is": the last one before the closing sentence)
    re.compile(r"final answer is\s*\$((?:(?!final answer is).)+?)\$\s*\.?\s*I hope it is correct", re.IGNORECASE | re.DOTALL),
    re.compile(r"final answer is\s*\$(.+?)\$", re.IGNORECASE | re.DOTALL),
    # unformatted: up to the end of the sentence or of the line ("3.5" keeps its point)
    re.compile(r"final answer is:?[ \t]*(.+?)[ \t]*(?:\.\s*I hope it is correct|\.?[ \t]*(?:\n|$)|\.\s)", re.IGNORECASE),
)


_MINERVA_TAIL = "hope it is correct"


def extract_math_answer(text: str) -> str | None:
    """Minerva-style answer extraction: "final answer is $X$", else the last ``\\boxed{}``.

    Why both: base models follow the 4-shot minerva format ("Final Answer: The final answer is
    $X$. I hope it is correct."), while instruct models, with a chat template, usually box their
    answer; lm-eval's minerva scorer reads the first, the MATH reference solutions the second.
    """
    if not text:
        return None
    # minerva's exact format only where its closing sentence is: without it, each "final answer is $"
    # would scan to the end of the text (quadratic in long completions)
    minerva = _MINERVA_TAIL in text.lower()
    for pattern in _FINAL_ANSWER_RES[0 if minerva else 1 :]:
        matches = pattern.findall(text)
        if matches:
            ans = matches[-1].strip()
            inner = remove_boxed(last_boxed_only_string(ans))
            return inner if inner is not None else ans
    return remove_boxed(last_boxed_only_string(text))


# --------------------------------------------------------------------------------------------
# MATH: normalisation (the cheap, deterministic first check and the fallback of math-verify)

_TEXT_CMD_RE = re.compile(r"\\(?:text|textbf|mathrm|mbox|textnormal|operatorname)\s*\{([^{}]*)\}")
_UNIT_WORDS = (
    "degrees",
    "degree",
    "units",
    "unit",
    "square units",
    "sq units",
    "cm",
    "mm",
    "km",
    "meters",
    "meter",
    "inches",
    "inch",
    "feet",
    "foot",
    "ft",
    "miles",
    "mile",
    "hours",
    "hour",
    "minutes",
    "minute",
    "seconds",
    "second",
    "cents",
    "cent",
    "dollars",
    "dollar",
    "pounds",
    "points",
    "ways",
    "days",
    "students",
    "people",
    "mph",
)
# Units are removed only where they cannot be algebra: a trailing \text{...} of plain words after
# a number or a closing brace ("10\text{ cm}", "5\text{ ways}"), or a known unit word after a
# space ("90 degrees"). A bare letter ("3m") is left alone: it may be a variable.
_UNIT_TEXT_TAIL_RE = re.compile(
    r"(?<=[\d}])\s*(?:\\[,;! ]\s*)*\\(?:text|mbox|mathrm)\{\s*[a-zA-Z][a-zA-Z ]*(?:\^\{?[23]\}?)?\s*\}(?:\^\{?[23]\}?)?$"
)
_UNIT_WORD_TAIL_RE = re.compile(
    r"(?<=\d)\s+(?:"
    + "|".join(sorted((re.escape(u) for u in _UNIT_WORDS), key=len, reverse=True))
    + r")(?:\^\{?[23]\}?)?$"
)


def _fix_fracs(s: str) -> str:
    """``\\frac12`` → ``\\frac{1}{2}``, ``\\frac1{2}`` → ``\\frac{1}{2}`` (shorthand LaTeX allows)."""
    out = []
    parts = s.split("\\frac")
    out.append(parts[0])
    for part in parts[1:]:
        out.append("\\frac")
        if part.startswith("{"):
            out.append(part)
            continue
        if len(part) < 2:
            out.append(part)
            continue
        a = part[0]
        if part[1] == "{":
            out.append("{" + a + "}" + part[1:])
        else:
            out.append("{" + a + "}{" + part[1] + "}" + part[2:])
    return "".join(out)


def normalize_math_answer(ans: str | None) -> str | None:
    """A canonical string for a MATH answer, for exact comparison and as math-verify's fallback.

    Removes what does not change the value: ``$``, spaces, ``\\left``/``\\right``, ``\\!``,
    ``\\dfrac``/``\\tfrac``, degrees, ``\\%``, trailing units and ``\\text{}`` wrappers, a lone
    ``x =`` in front, thousands commas, trailing zeros of decimals; turns ``a/b`` of integers
    into ``\\frac{a}{b}``, and a number in decimal or fraction form into one canonical form so
    ``0.5`` and ``\\frac{1}{2}`` compare equal even when sympy is unavailable.
    """
    if ans is None:
        return None
    s = str(ans).strip()
    inner = remove_boxed(last_boxed_only_string(s))
    if inner is not None and s.startswith(("\\boxed", "\\fbox")):
        s = inner
    s = s.replace("\n", "").strip().strip("$").strip()
    s = s.rstrip(".").strip()
    s = s.replace("\\!", "").replace("\\,", "").replace("\\;", "").replace("\\ ", "")
    s = s.replace("\\left", "").replace("\\right", "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "").replace("°", "")
    s = s.replace("\\%", "").replace("%", "").replace("\\$", "")
    s = _UNIT_TEXT_TAIL_RE.sub("", s).strip()
    s = _UNIT_WORD_TAIL_RE.sub("", s).strip()
    # \text{...} wrappers: keep the words (answers like \text{Evelyn}) but not the command
    prev = None
    while prev != s:
        prev = s
        s = _TEXT_CMD_RE.sub(r"\1", s)
    # a single "x =" / "k=" in front of the value
    # (only when the right side is a constant: "y = 2x+3" is an equation, not the value 2x+3)
    m = re.match(r"^\s*[a-zA-Z]\s*=\s*(.+)$", s)
    if m and "=" not in m.group(1) and not re.search(r"[a-zA-Z]", re.sub(r"\\[a-zA-Z]+", "", m.group(1))):
        s = m.group(1)
    s = s.replace(" ", "")
    s = _fix_fracs(s)
    s = s.replace("\\{", "{").replace("\\}", "}")
    # thousands separators "1,000" (but not tuples "1,2")
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    if s.startswith("."):
        s = "0" + s
    value = _as_rational(s)
    if value is not None:
        return (
            str(value.numerator)
            if value.denominator == 1
            else f"\\frac{{{value.numerator}}}{{{value.denominator}}}"
        )
    return s


def _as_rational(s: str) -> Fraction | None:
    """Exact value of ``3``, ``-0.25``, ``a/b`` or ``\\frac{a}{b}`` (integers), else ``None``."""
    m = re.fullmatch(r"(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}", s)
    try:
        if m:
            value = Fraction(int(m.group(2)), int(m.group(3)))
            return -value if m.group(1) else value
        if re.fullmatch(r"-?\d+(\.\d+)?", s) or re.fullmatch(r"-?\d+/-?\d+", s):
            return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None
    return None


# --------------------------------------------------------------------------------------------
# MATH: equivalence

_MV_TIMEOUT_S = 5
# a number raised to a power that itself holds a power of a number, or to a literal of 7+ digits
_POWER_TOWER_RE = re.compile(r"\^\s*\{?\s*(?:[\d.]+\s*\^|\d{7,})")
# two plain numbers that math-verify calls equal must also agree to this relative tolerance: it rounds
# both to 6 decimals, which equates 0.0000668 and 0.0000672
_MATH_REL_TOL = Fraction(1, 10**6)


def _math_verify_equal(pred: str, gold: str, timeout_s: int) -> bool | None:
    """math-verify's verdict, or ``None`` when it is not installed or gave up.

    math-verify guards itself with ``signal.alarm``, which only works in the main thread; in
    any other thread (a thread-pool scorer, a web demo) we run it with its own timeouts off, in
    a daemon thread that we stop waiting for after ``2 * timeout_s`` (its parse and its verify):
    a slow expression then costs one abandoned thread, never a hung benchmark. A numeric power
    tower (``10^{10^{10}}``) is not handed to it at all: sympy would build the integer in one C call
    that holds the interpreter lock, so neither the alarm nor the abandoned thread could stop it.
    """
    if _POWER_TOWER_RE.search(pred) or _POWER_TOWER_RE.search(gold):
        logger.warning("not evaluating the power tower in %r vs %r; using the string fallback", pred, gold)
        return None
    try:
        from math_verify import parse, verify
    except ImportError:  # pragma: no cover - depends on the environment
        return None

    def wrap(x: str) -> str:
        x = x.strip()
        return x if x.startswith("$") or x.startswith("\\boxed") else f"${x}$"

    def run(t: int | None) -> bool:
        g = parse(wrap(gold), parsing_timeout=t)
        p = parse(wrap(pred), parsing_timeout=t)
        if not g or not p:
            return False
        return bool(verify(g, p, timeout_seconds=t))

    if threading.current_thread() is threading.main_thread():
        try:
            return run(timeout_s)
        except Exception:  # math-verify raises on odd inputs; treat as "no verdict"
            logger.debug("math-verify failed on %r vs %r", pred, gold, exc_info=True)
            return None

    box: list[bool | None] = [None]

    def target() -> None:
        try:
            box[0] = run(None)
        except Exception:
            logger.debug("math-verify failed on %r vs %r", pred, gold, exc_info=True)

    worker = threading.Thread(target=target, daemon=True, name="math-verify")
    worker.start()
    worker.join(timeout_s * 2)
    if worker.is_alive():
        logger.warning("math-verify timed out on %r vs %r; using the string fallback", pred, gold)
        return None
    return box[0]


def math_is_equivalent(pred: str | None, gold: str | None, timeout_s: int = _MV_TIMEOUT_S) -> bool:
    """Whether a predicted MATH answer equals the gold one *as mathematics*.

    Order: (1) normalised-string equality (fast, and deterministic for the common cases);
    (2) math-verify (sympy + latex2sympy2_extended), which decides ``\\frac{1}{2}`` vs ``0.5``,
    ``x=3`` vs ``3``, ``\\sqrt{2}/2`` vs ``\\frac{\\sqrt2}{2}``, intervals, sets and tuples; two plain numbers it
    calls equal must also agree to a relative 1e-6 (it rounds to 6 decimals). If math-verify is missing or
    times out, the string verdict of (1) stands.
    """
    if pred is None or gold is None:
        return False
    np_, ng = normalize_math_answer(pred), normalize_math_answer(gold)
    if not np_ or not ng:
        return False
    if np_ == ng:
        return True
    verdict = bool(_math_verify_equal(pred, gold, timeout_s))
    rp, rg = _as_rational(np_), _as_rational(ng)
    if verdict and rp is not None and rg is not None:
        return abs(rp - rg) <= _MATH_REL_TOL * abs(rg)
    return verdict


def math_is_correct(completion: str, gold_answer: str) -> Score:
    """Score a MATH completion: extract (minerva / boxed), then compare by equivalence."""
    pred = extract_math_answer(completion)
    correct = pred is not None and math_is_equivalent(pred, gold_answer)
    return Score(correct=correct, extracted=pred, detail=f"gold={gold_answer}")


# a line of code rather than prose: indented, or opening with a statement keyword or a decorator
_CODE_LINE_RE = re.compile(r"^(?:[ \t]+\S|(?:def|class|import|from|return|if|for|while|with|try|async)\b|@)", re.M)
_FENCE_RE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)


def extract_code(completion: str, stops: Sequence[str] = ()) -> str:
    """The code in a completion: the first fenced block if there is one, else the text; cut at
    ``stops`` (e.g. ``[DONE]``). A fence that follows code (a bare function body, then the
    closing fence of the prompt's block) closes that code instead of opening a block.

    Why: chat models answer "Here is the function:\\n```python\\n...\\n```", base models with
    few-shot prompts continue with bare code and then invent the next example. Both must reach
    the tests as plain code. An unclosed fence (generation length ran out) still counts.
    """
    text = completion.replace("\r\n", "\n")
    # a stop sequence before any fence ends the answer (base models: "...code\n[DONE]\n\nYou are ...")
    head = truncate_at(text, stops)
    first = head.find("```")
    if first >= 0:
        if _CODE_LINE_RE.search(head[:first]):  # bare code (a function body) then a closing fence
            text = head[:first]
        elif (m := _FENCE_RE.search(text)) is not None:
            text = m.group(2)
    text = truncate_at(text, stops)
    # leftovers of the few-shot format
    text = text.replace("[BEGIN]", "")
    return text.rstrip() + "\n" if text.strip() else ""
