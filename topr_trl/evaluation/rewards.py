"""Verifiable rewards for GSM8K and MATH: answer extraction, correctness, and TRL reward functions.

Every answer is put in one of three classes, following the evaluation convention of the TOPR paper
(Le Roux et al., 2025, "Tapered Off-Policy REINFORCE", arXiv:2503.14286):

* ``"correct"``: an answer was found and it equals the reference;
* ``"incorrect"``: an answer was found and it differs from the reference;
* ``"invalid"``: no answer could be found in the completion (no marker, no number, an empty box...).

The paper rewards correct answers with +1 and everything else with -1, i.e. an invalid answer counts as an
incorrect one. The reward factories below (`make_gsm8k_reward`, `make_math_reward`) keep that default but let
the three classes map to any rewards, e.g. to penalise invalid answers harder.

GSM8K answers are numbers, compared numerically (exactly, as fractions), after extraction from an explicit
marker (``The answer is``, ``####``, ``A:`` at the start of a line, or ``\\boxed{...}``; the last marker in
the text wins) or, optionally, the last number of the completion. MATH answers are the content of the last
``\\boxed{...}``, compared with the reference by the `math-verify` library (imported lazily, only when a
MATH answer is checked); without it, a documented normalised string comparison is used instead.

The reward functions follow TRL's signature ``f(completions, answer, **kwargs) -> list[float]``: the dataset
must have an ``answer`` column holding the reference (a bare answer, or a full reference solution from which
the answer is extracted), and ``completions`` may be plain strings or conversational message lists.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable
from fractions import Fraction


logger = logging.getLogger(__name__)

CORRECT = "correct"
INCORRECT = "incorrect"
INVALID = "invalid"
ANSWER_CLASSES = (CORRECT, INCORRECT, INVALID)


def completion_text(completion) -> str:
    """The text of a completion, conversational (a list of messages) or plain."""
    if isinstance(completion, list):
        return "".join(message.get("content", "") for message in completion)
    return completion


_completion_text = completion_text  # the checkers below take a parameter of that name

__all__ = [
    "ANSWER_CLASSES",
    "CORRECT",
    "INCORRECT",
    "INVALID",
    "classify_gsm8k",
    "classify_math",
    "completion_text",
    "extract_boxed",
    "extract_gsm8k_answer",
    "format_reward",
    "gsm8k_numbers_equal",
    "gsm8k_reward",
    "has_answer_marker",
    "make_format_reward",
    "make_gsm8k_reward",
    "make_math_reward",
    "math_answers_equal",
    "math_reward",
    "normalize_math_answer",
    "parse_gsm8k_number",
]

# ---------------------------------------------------------------------------------------------------------
# Numbers
# ---------------------------------------------------------------------------------------------------------

# A number as written in a GSM8K solution: an optional sign (ASCII hyphen or Unicode minus, not glued to a
# preceding word or digit, so "10-3" is two numbers, and glued to what follows, so "5 - 3" has no "-3"), an
# optional currency symbol on either side of the sign, digits with optional thousands commas ("1,234", but
# "3,4" is two numbers), an optional decimal part (".4" alone too),
# and an optional denominator making a simple fraction ("1/2"). Units and words after it are ignored.
_NUMBER = re.compile(
    r"""
    (?:(?<![\w).\]}])(?P<sign>[-\u2212]))?             # sign, not glued to a word, digit or bracket
    (?:(?:\\?\$|€|£)\s?)?                              # currency: "$3", "-$3" ("$-3" is rewritten first)
    (?P<int>(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+)  # "1,234", "1234", "2.50", ".4"
    (?:\s*/\s*(?P<den>\d+(?:\.\d+)?))?                        # "/2" of a simple fraction
    """,
    re.VERBOSE,
)
_CURRENCY_BEFORE_SIGN = re.compile(r"(?:\\?\$|€|£)\s*([-\u2212])")
_CALCULATOR_ANNOTATION = re.compile(r"<<[^<>]*>>")
_LATEX_FRAC = re.compile(r"\\[dt]?frac\s*\{\s*([^{}]*?)\s*\}\s*\{\s*([^{}]*?)\s*\}")
_LATEX_FRAC_SHORT = re.compile(r"\\[dt]?frac\s*(\d)\s*(\d)")
_LATEX_TEXT = re.compile(r"\\(?:text|textbf|mathrm|mathbf|mbox)\s*\{([^{}]*)\}")
_LATEX_SPACES = re.compile(r"\\[!,;: ]|~")


def _clean_latex_number_text(text: str) -> str:
    """Rewrite the LaTeX found around numbers into plain text: `\\frac{1}{2}` -> `1/2`, `1{,}200` -> `1,200`,
    `\\text{ eggs}` -> ` eggs`, thin spaces and `\\left`/`\\right` removed, `$-3` -> `-$3`."""
    text = text.replace("{,}", ",")
    text = _LATEX_SPACES.sub("", text)
    text = text.replace("\\left", "").replace("\\right", "").replace("\\%", "%")
    text = _LATEX_TEXT.sub(r"\1", text)
    text = _LATEX_FRAC.sub(r"\1/\2", text)
    text = _LATEX_FRAC_SHORT.sub(r"\1/\2", text)
    return _CURRENCY_BEFORE_SIGN.sub(r"\1", text)


def _match_to_string(match: re.Match) -> str:
    """The canonical literal of a `_NUMBER` match: sign, digits without commas, optional `/denominator`."""
    sign = "-" if match.group("sign") else ""
    value = sign + match.group("int").replace(",", "")
    if match.group("den"):
        value += "/" + match.group("den")
    return value


def _to_fraction(literal: str) -> Fraction | None:
    """The exact value of a canonical literal, or None for a zero denominator."""
    numerator, _, denominator = literal.partition("/")
    value = Fraction(numerator)
    if denominator:
        if Fraction(denominator) == 0:
            return None
        value /= Fraction(denominator)
    return value


def _first_number(text: str) -> str | None:
    match = _NUMBER.search(_clean_latex_number_text(text))
    return _match_to_string(match) if match else None


def _last_number(text: str) -> str | None:
    matches = list(_NUMBER.finditer(_clean_latex_number_text(_CALCULATOR_ANNOTATION.sub(" ", text))))
    return _match_to_string(matches[-1]) if matches else None


def parse_gsm8k_number(text: str | int | float | Fraction | None) -> Fraction | None:
    """The exact value of the first number in `text` (a `Fraction`), or None when there is none.

    Understands thousands commas (`"1,234"`), currency (`"$18"`, `"-$3"`, `"18 dollars"`), units (`"5 km"`),
    signs (`"-3"`), decimals (`"2.50"`, `".4"`), simple fractions (`"1/2"`) and LaTeX fractions
    (`"\\frac{1}{2}"`). Numbers (int, float, Fraction) are accepted as they are."""
    if text is None:
        return None
    if isinstance(text, (int, Fraction)):
        return Fraction(text)
    if isinstance(text, float):
        return Fraction(str(text))
    literal = _first_number(str(text))
    return _to_fraction(literal) if literal is not None else None


def gsm8k_numbers_equal(a, b) -> bool:
    """Whether two GSM8K answers are the same number (exact comparison as fractions, so `"18.00" == "18"`,
    `"$1,200" == "1200"`, `"1/2" == "0.5"`, but `"0.33" != "1/3"`). False when either has no number."""
    value_a, value_b = parse_gsm8k_number(a), parse_gsm8k_number(b)
    return value_a is not None and value_b is not None and value_a == value_b


# ---------------------------------------------------------------------------------------------------------
# Boxes
# ---------------------------------------------------------------------------------------------------------

_BOX_START = re.compile(r"\\(?:boxed|fbox)\s*")


def _boxes(text: str) -> list[tuple[int, str]]:
    """(position, content) of every complete `\\boxed{...}` / `\\fbox{...}` in `text`, in order, nested braces
    included. `\\boxed 5` (no braces) boxes the following token. A box whose braces never close (a truncated
    completion) is skipped."""
    found = []
    for start in _BOX_START.finditer(text):
        position = start.end()
        if position < len(text) and text[position] == "{":
            depth = 0
            for index in range(position, len(text)):
                char = text[index]
                if char == "{" and (index == 0 or text[index - 1] != "\\"):
                    depth += 1
                elif char == "}" and (index == 0 or text[index - 1] != "\\"):
                    depth -= 1
                    if depth == 0:
                        found.append((start.start(), text[position + 1 : index]))
                        break
        elif start.group(0) != start.group(0).rstrip():
            token = re.match(r"[^\s$]+", text[position:])
            if token:
                found.append((start.start(), token.group(0)))
    return found


def extract_boxed(text: str) -> str | None:
    """The content of the last complete `\\boxed{...}` (or `\\fbox{...}`) in `text`, stripped, nested braces
    kept (`"\\boxed{\\frac{1}{2}}"` -> `"\\frac{1}{2}"`); None when there is no complete box."""
    boxes = _boxes(text)
    return boxes[-1][1].strip() if boxes else None


# ---------------------------------------------------------------------------------------------------------
# GSM8K
# ---------------------------------------------------------------------------------------------------------

# Line-based markers: the answer is on the rest of the line (or on the next non-empty line when the marker
# ends its line). "A:" only counts at the start of a line, so "Plan A: 3 apples" is not an answer.
_LINE_MARKERS = re.compile(r"(?i:\banswer\s*(?:is\s*:?|:))|####|(?m:^[ \t*]*A:)")
_EQUALS = re.compile(r"=")
_SENTENCE_END = re.compile(r"\.(?=\s|$)")


def _marker_answers(text: str) -> list[tuple[int, str | None]]:
    """(position, number or None) for every answer marker in `text`, in order of position."""
    candidates: list[tuple[int, str | None]] = []
    for marker in _LINE_MARKERS.finditer(text):
        rest = text[marker.end() :].lstrip()
        line = _CALCULATOR_ANNOTATION.sub(" ", rest.split("\n", 1)[0])
        sentence = _SENTENCE_END.split(line, maxsplit=1)[0]
        # "The answer is 3 + 4 = 7.": the value after the sentence's last "=" is the answer.
        parts = _EQUALS.split(sentence)
        number = _first_number(parts[-1]) if len(parts) > 1 else None
        candidates.append((marker.start(), number if number is not None else _first_number(line)))
    for position, content in _boxes(text):
        candidates.append((position, _first_number(content)))
    candidates.sort(key=lambda candidate: candidate[0])
    return candidates


def extract_gsm8k_answer(text: str, fallback_to_last_number: bool = True) -> str | None:
    """The final numeric answer of a GSM8K solution, as a canonical literal (`"1200"`, `"-3"`, `"2.50"`,
    `"1/2"`: sign, digits without thousands commas or currency, optional `/denominator`), or None.

    Looks for answer markers: `The answer is` (any case, also `final answer is`, `Answer:`), `####`, `A:` at
    the start of a line, and `\\boxed{...}`. The answer of a line marker is the first number on the rest of its
    line, or the first number after the last `=` of that line's first sentence (`The answer is 3 + 4 = 7.`);
    that of a box is the first number inside it. When several markers occur, the LAST one that carries a
    number wins. Calculator annotations (`<<9*2=18>>`) are ignored. With `fallback_to_last_number` (the
    default), a completion without any usable marker is answered by its last number; without it, such a
    completion has no answer.

    Completions that keep writing after their answer (a base model starting a new `Q:` ... `A:`) should be
    stopped at a stop string: the last marker is the one that counts here."""
    text = _completion_text(text)
    for _, number in reversed(_marker_answers(text)):
        if number is not None:
            return number
    return _last_number(text) if fallback_to_last_number else None


def _reference_number(reference) -> Fraction:
    """The value of a GSM8K reference: a bare number (`"18"`, `18`, `"1,200"`) or a full reference solution
    ending in `#### 18` or `A: 18`."""
    if isinstance(reference, (int, float, Fraction)):
        return parse_gsm8k_number(reference)
    text = str(reference)
    bare = _NUMBER.fullmatch(_clean_latex_number_text(text.strip()))
    literal = _match_to_string(bare) if bare else extract_gsm8k_answer(text, fallback_to_last_number=True)
    value = _to_fraction(literal) if literal is not None else None
    if value is None:
        raise ValueError(f"no number in the GSM8K reference answer {text!r}")
    return value


def classify_gsm8k(completion_text: str, reference, fallback_to_last_number: bool = True) -> str:
    """`"correct"`, `"incorrect"` or `"invalid"` (no answer found) for a GSM8K completion against `reference`
    (a number, or a reference solution ending in `#### <n>` / `A: <n>`), compared numerically.

    Raises ValueError when the reference itself has no number (a data error, not a wrong answer)."""
    answer = extract_gsm8k_answer(_completion_text(completion_text), fallback_to_last_number=fallback_to_last_number)
    if answer is None:
        return INVALID
    value = _to_fraction(answer)
    if value is None:
        return INVALID
    return CORRECT if value == _reference_number(reference) else INCORRECT


# ---------------------------------------------------------------------------------------------------------
# MATH
# ---------------------------------------------------------------------------------------------------------

_MATH_TEXT_WRAPPERS = re.compile(r"\\(?:text|textbf|textrm|mathrm|mathbf|mbox)\s*\{([^{}]*)\}")
_MATH_FRAC_SHORT = re.compile(r"\\frac(\d)(\d)")
_MATH_DEGREES = re.compile(r"\^\s*\{?\s*\\circ\s*\}?")


def normalize_math_answer(answer: str) -> str:
    """A normalised form of a LaTeX answer, used only when `math-verify` cannot parse an answer (or with
    `use_math_verify=False`): strips `$`, spaces, `\\left`/`\\right`, thin spaces (`\\!`, `\\,`, `\\;`), degree signs,
    `\\%`, `\\text{...}`-style wrappers (keeping their content) and a trailing period; turns `\\dfrac`/`\\tfrac` into
    `\\frac` and `\\frac12` into `\\frac{1}{2}`. Two answers are then equal when their normalised strings are equal, or
    when both are plain numbers (`1,000`, `-0.75`, `3/4`, `\\frac{3}{4}`) with the same value. Nothing symbolic:
    `2\\sqrt{2}` and `\\sqrt{8}` differ here."""
    text = answer.strip()
    text = text.replace("$", "")
    text = _MATH_DEGREES.sub("", text)
    text = _MATH_TEXT_WRAPPERS.sub(r"\1", text)
    for old, new in (("\\left", ""), ("\\right", ""), ("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"), ("\\%", "")):
        text = text.replace(old, new)
    text = _LATEX_SPACES.sub("", text)
    text = _MATH_FRAC_SHORT.sub(r"\\frac{\1}{\2}", text)
    text = re.sub(r"\s+", "", text).rstrip(".")
    return text


_PLAIN_NUMBER = re.compile(r"-?(?:\d+(?:\.\d+)?|\.\d+)(?:/\d+)?")
_PLAIN_FRAC = re.compile(r"(-?)\\frac\{(-?\d+)\}\{(\d+)\}")


def _plain_value(normalised: str) -> Fraction | None:
    """The value of a normalised answer that is a plain number (`"1,000"`, `"-0.75"`, `"3/4"`,
    `"\\frac{3}{4}"`), else None."""
    text = normalised.replace(",", "")
    frac = _PLAIN_FRAC.fullmatch(text)
    if frac:
        text = f"{frac.group(1)}{frac.group(2)}/{frac.group(3)}".replace("--", "")
    return _to_fraction(text) if _PLAIN_NUMBER.fullmatch(text) else None


def _normalised_equal(prediction: str, reference: str) -> bool:
    a, b = normalize_math_answer(prediction), normalize_math_answer(reference)
    if a == b:
        return True
    value_a, value_b = _plain_value(a), _plain_value(b)
    return value_a is not None and value_a == value_b


def _math_verify_equal(prediction: str, reference: str) -> bool | None:
    """`math-verify`'s verdict (a required dependency, imported on first use), or None when it cannot parse one of
    the answers."""
    import math_verify  # noqa: PLC0415 - lazy by design: on the first MATH answer

    # math-verify's timeouts use SIGALRM, which only the main thread may set.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    gold = math_verify.parse(f"${reference}$", parsing_timeout=timeout)
    predicted = math_verify.parse(f"${prediction}$", parsing_timeout=timeout)
    if not gold or not predicted:
        return None
    return bool(math_verify.verify(gold, predicted, timeout_seconds=timeout))


def math_answers_equal(prediction: str, reference: str, use_math_verify: bool = True) -> bool:
    """Whether two MATH answers (LaTeX, without `\\boxed`) are mathematically equivalent.

    With `use_math_verify` (the default), `math-verify`'s `parse` + `verify` decide: `\\frac{1}{2}` equals `0.5`
    and `\\dfrac12`, `2\\sqrt{2}` equals `\\sqrt{8}`, `x^2+2x` equals `x(x+2)`; answers whose normalised strings
    (`normalize_math_answer`) match are accepted too. When it cannot parse one of the answers, or without
    `use_math_verify`, only that normalised string comparison decides."""
    if use_math_verify:
        verdict = _math_verify_equal(prediction, reference)
        if verdict is not None:
            return verdict or _normalised_equal(prediction, reference)
    return _normalised_equal(prediction, reference)


def classify_math(completion_text: str, reference: str, use_math_verify: bool = True) -> str:
    """`"correct"`, `"incorrect"` or `"invalid"` for a MATH completion against `reference`.

    The answer is the content of the completion's last complete `\\boxed{...}`; no box, or an empty one, is
    invalid. The reference is either the bare answer (MATH's `answer` column) or a full reference solution, in
    which case its last box is the answer."""
    answer = extract_boxed(_completion_text(completion_text))
    if not answer:
        return INVALID
    reference = str(reference)
    if "\\boxed" in reference or "\\fbox" in reference:
        boxed_reference = extract_boxed(reference)
        if boxed_reference is not None:
            reference = boxed_reference
    return CORRECT if math_answers_equal(answer, reference, use_math_verify=use_math_verify) else INCORRECT


# ---------------------------------------------------------------------------------------------------------
# TRL reward functions
# ---------------------------------------------------------------------------------------------------------


def _make_class_reward(
    classify: Callable[[str, object], str], correct: float, incorrect: float, invalid: float | None, name: str, doc: str
):
    rewards = {
        CORRECT: float(correct),
        INCORRECT: float(incorrect),
        INVALID: float(incorrect if invalid is None else invalid),
    }

    def reward(completions, answer, **kwargs) -> list[float]:
        return [rewards[classify(_completion_text(c), a)] for c, a in zip(completions, answer, strict=True)]

    reward.__name__ = reward.__qualname__ = name
    reward.__doc__ = doc
    reward.rewards = dict(rewards)
    return reward


def make_gsm8k_reward(
    correct: float = 1.0,
    incorrect: float = -1.0,
    invalid: float | None = None,
    fallback_to_last_number: bool = True,
    name: str = "gsm8k_reward",
):
    """A TRL reward function `f(completions, answer, **kwargs) -> list[float]` for GSM8K.

    Each completion is classed by `classify_gsm8k` against the `answer` column and rewarded `correct`,
    `incorrect` or `invalid` (None: the same as `incorrect`, the paper's convention). The function's
    `__name__` is `name` (TRL logs the reward under it); its `rewards` attribute holds the class mapping."""

    def classify(text, reference):
        return classify_gsm8k(text, reference, fallback_to_last_number=fallback_to_last_number)

    doc = (
        f"GSM8K reward (TRL signature): correct={correct}, incorrect={incorrect}, "
        f"invalid={incorrect if invalid is None else invalid}, fallback_to_last_number={fallback_to_last_number}."
    )
    return _make_class_reward(classify, correct, incorrect, invalid, name, doc)


def make_math_reward(
    correct: float = 1.0,
    incorrect: float = -1.0,
    invalid: float | None = None,
    use_math_verify: bool = True,
    name: str = "math_reward",
):
    """A TRL reward function `f(completions, answer, **kwargs) -> list[float]` for MATH: the last `\\boxed{}`
    of each completion is compared with the `answer` column by `classify_math` (math-verify), and rewarded
    `correct`, `incorrect` or `invalid` (None: the same as `incorrect`). The function's `__name__` is `name`."""

    def classify(text, reference):
        return classify_math(text, reference, use_math_verify=use_math_verify)

    doc = (
        f"MATH reward (TRL signature): correct={correct}, incorrect={incorrect}, "
        f"invalid={incorrect if invalid is None else invalid}, last \\boxed{{}} checked by math-verify."
    )
    return _make_class_reward(classify, correct, incorrect, invalid, name, doc)


def has_answer_marker(text: str) -> bool:
    """Whether `text` states an answer explicitly: a complete `\\boxed{...}` with content, or a GSM8K marker
    (`The answer is`, `####`, `A:` at a line start) followed by a number on its line."""
    text = _completion_text(text)
    if any(content.strip() for _, content in _boxes(text)):
        return True
    return any(number is not None for _, number in _marker_answers(text))


def make_format_reward(present: float = 1.0, absent: float = -1.0, name: str = "format_reward"):
    """A TRL reward function `f(completions, **kwargs) -> list[float]` that ignores correctness: `present` when
    the completion states its answer explicitly (`has_answer_marker`), `absent` otherwise."""

    def reward(completions, **kwargs) -> list[float]:
        return [float(present) if has_answer_marker(_completion_text(c)) else float(absent) for c in completions]

    reward.__name__ = reward.__qualname__ = name
    reward.__doc__ = f"Format reward (TRL signature): {present} with an explicit answer marker, {absent} without."
    return reward


gsm8k_reward = make_gsm8k_reward()
"""GSM8K reward with the paper's defaults: +1 correct, -1 incorrect or invalid, last-number fallback on."""

math_reward = make_math_reward()
"""MATH reward with the paper's defaults: +1 correct, -1 incorrect or invalid."""

format_reward = make_format_reward()
"""+1 when the completion has an explicit answer marker (a box, `The answer is`, `####`, `A:`), -1 otherwise."""
