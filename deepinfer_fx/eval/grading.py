"""Answer extraction and grading, one rule per task (as the upstream graders read a response).

- AIME: the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces matched so nested ones survive;
  its content normalised and read as an integer. No box: no answer (the prompt asks for one).
- GPQA: the last ``Answer: X`` / ``answer is (X)``; else the last ``\\boxed{X}``; else a lone
  letter A-D ending the last non-empty line.
- HLE: the text after the last ``Answer:`` up to the line's end (the prompt asks for
  ``Explanation / Answer / Confidence`` lines); exactMatch compares normalised strings,
  multipleChoice the letter at its start. The official HLE score uses an LLM judge; this exact
  match is stricter (a lower bound).
"""

from __future__ import annotations

import re

LETTERS = "ABCD"
_BOX = re.compile(r"\\(?:boxed|fbox)\s*\{")
_ANSWER_LETTER = re.compile(r"(?i:answer)\s*(?:is|:)?\s*[*:\s]*[\(\[\$]?\s*(?:\\text\{)?([A-J])\b")
_LONE_LETTER = re.compile(r"(?:^|[\s\(\[\*])([A-J])[\)\]\.\*]*\s*$")
_HLE_ANSWER = re.compile(r"(?i:answer)\s*:\s*(.*)")


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}``, nested braces included; None if absent or unclosed."""
    found = None
    for m in _BOX.finditer(text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            found = text[m.end() : i - 1]
    return found


def normalise_number(text: str) -> int | None:
    """An AIME answer as an integer: drops ``$``, spaces, thousands commas, ``\\text{}``, a
    degree sign, outer braces and a ``.0``; None when what remains is not an integer."""
    s = text.strip().strip("$").strip()
    s = re.sub(r"\\text\{([^{}]*)\}", r"\1", s)
    s = re.sub(r"\^\s*\{?\\circ\}?|°", "", s)
    s = s.replace("\\,", "").replace("\\!", "").replace(",", "").replace(" ", "")
    s = s.strip("{}").strip(".")
    if re.fullmatch(r"[+-]?\d+(\.0+)?", s):
        return int(float(s)) if "." in s else int(s)
    return None


def extract_aime(response: str) -> int | None:
    boxed = last_boxed(response)
    return None if boxed is None else normalise_number(boxed)


def extract_letter(response: str, letters: str = LETTERS) -> str | None:
    """The chosen letter of a multiple-choice response (see the module docstring for the order)."""
    hits = [m.group(1) for m in _ANSWER_LETTER.finditer(response) if m.group(1) in letters]
    if hits:
        return hits[-1]
    boxed = last_boxed(response)
    if boxed is not None:
        inner = re.sub(r"\\text\{([^{}]*)\}", r"\1", boxed).strip().strip("()")
        if len(inner) == 1 and inner in letters:
            return inner
    lines = [ln for ln in response.splitlines() if ln.strip()]
    if lines:
        m = _LONE_LETTER.search(lines[-1])
        if m and m.group(1) in letters:
            return m.group(1)
    return None


def extract_hle(response: str) -> str | None:
    """The last ``Answer:`` line's text, or None."""
    hits = _HLE_ANSWER.findall(response)
    if not hits:
        return None
    answer = hits[-1].strip()
    return answer or None


def normalise_text(text: str) -> str:
    """Case, surrounding ``$``/``**``/quotes, ``\\boxed{}``, trailing full stop and runs of spaces
    do not count in an exact match."""
    s = text.strip()
    boxed = last_boxed(s)
    if boxed is not None:
        s = boxed
    s = s.strip().strip("*").strip("$").strip().strip("\"'`").strip()
    s = re.sub(r"\s+", " ", s).rstrip(".").strip()
    return s.lower()


def grade_aime(response: str, answer: int) -> tuple[bool, int | None]:
    got = extract_aime(response)
    return got is not None and got == int(answer), got


def grade_letter(response: str, correct: str) -> tuple[bool, str | None]:
    got = extract_letter(response)
    return got == correct, got


def grade_hle(response: str, answer: str, answer_type: str) -> tuple[bool, str | None]:
    got = extract_hle(response)
    if got is None:
        return False, None
    if answer_type == "multipleChoice":
        letter = extract_letter(got, "ABCDEFGHIJ") or got.strip()[:1].upper()
        return letter == answer.strip().upper(), letter
    return normalise_text(got) == normalise_text(answer), got
