"""The book's formulas as MathML, written when mdBook builds the book: no script, no network.

Chapters write math the way GitHub renders it, so the Markdown reads right there too: `$...$` inline,
`$$...$$` for a displayed formula. mdBook runs this file as a preprocessor (book/book.toml), before
its Markdown parser sees the text: each formula becomes one line of MathML (latex2mathml), which every
current browser typesets. Doing it before the Markdown parser is what keeps `\\,` a thin space (Markdown
would read `\\,` as an escaped comma).

A formula latex2mathml does not understand (`\\omgea`) stops the build with the chapter and the formula,
instead of showing raw LaTeX to a reader.

    python course/book_math.py supports html    # mdBook asks first: exit 0 means "I handle this renderer"
    python course/book_math.py < [context, book] > book   # the preprocessor protocol: JSON in, JSON out
"""

import json
import re
import sys

from latex2mathml.converter import convert

# What the scanner recognises in prose (fenced code blocks are left out line by line first), in order of
# precedence: an inline code span, an escaped dollar, a displayed formula, an inline formula. An inline
# formula follows GitHub's rule: no space just inside the dollars, no digit right after the closing one
# ("$5 and $6" is not math), and no blank line inside.
FENCE = re.compile(r"^[ \t]*(```+|~~~+)")
MATH_OR_CODE = re.compile(
    r"(?P<code>(`+)[\s\S]+?\2)"
    r"|(?P<escaped>\\\$)"
    r"|\$\$(?P<display>[\s\S]+?)\$\$"
    r"|\$(?P<inline>(?=\S)(?:[^$\n]|\n(?![ \t]*\n))*?\S)\$(?!\d)"
)
# Text between MathML tags: the Markdown parser still reads it (the tags are inline HTML to it), so every
# character that is not a letter, digit or space goes in as a character reference.
TEXT = re.compile(r">([^<]+)<")
ENTITY = re.compile(r"&#?\w+;")
SPECIAL = re.compile(r"(?P<entity>&#?\w+;)|(?P<char>[^A-Za-z0-9 ])")
UNKNOWN_COMMAND = re.compile(r"\\[A-Za-z]+|\\.")


class FormulaError(ValueError):
    """A formula latex2mathml could not turn into MathML."""


def to_mathml(latex: str, display: bool) -> str:
    """One formula as one line of MathML whose text the Markdown parser leaves alone."""
    try:
        mathml = convert(latex.strip(), display="block" if display else "inline")
    except Exception as error:  # latex2mathml raises several types for malformed input
        raise FormulaError(f"cannot typeset ${latex}$: {error}") from error
    # latex2mathml keeps an unknown command as text (<mi>\omgea</mi>): a reader would see raw LaTeX.
    for text in TEXT.findall(mathml):
        unknown = UNKNOWN_COMMAND.search(ENTITY.sub("", text))
        if unknown:
            raise FormulaError(f"cannot typeset ${latex.strip()}$: unknown command {unknown.group()}")
    return TEXT.sub(lambda m: ">" + _references(m.group(1)) + "<", mathml.replace("\n", " "))


def _references(text: str) -> str:
    """`text` with every character but letters, digits and spaces as a character reference (`_` -> `&#x5F;`)."""
    return SPECIAL.sub(lambda m: m.group("entity") or f"&#x{ord(m.group('char')):X};", text)


def render(markdown: str) -> str:
    """A chapter with every formula outside code turned into MathML."""

    def replace(match: re.Match) -> str:
        if match.group("display") is not None:
            return to_mathml(match.group("display"), display=True)
        if match.group("inline") is not None:
            return to_mathml(match.group("inline"), display=False)
        return match.group(0)  # code, or an escaped dollar: as written

    pieces, prose, fence = [], [], None  # fence: the marks of the open code block (```), None in prose
    for line in markdown.splitlines(keepends=True):
        if fence is not None:
            pieces.append(line)
            closing = line.strip()
            if closing.startswith(fence) and not closing.strip(fence[0]):
                fence = None
        elif opening := FENCE.match(line):
            pieces.append(MATH_OR_CODE.sub(replace, "".join(prose)))
            pieces.append(line)
            prose, fence = [], opening.group(1)
        else:
            prose.append(line)
    pieces.append(MATH_OR_CODE.sub(replace, "".join(prose)))
    return "".join(pieces)


def _chapters(items: list):
    for item in items:
        chapter = item.get("Chapter") if isinstance(item, dict) else None
        if chapter:
            yield chapter
            yield from _chapters(chapter["sub_items"])


def main(argv: list[str]) -> int:
    if len(argv) >= 1 and argv[0] == "supports":
        return 0 if argv[1:] == ["html"] else 1
    _context, book = json.load(sys.stdin)
    problems = []
    for chapter in _chapters(book["items"]):
        try:
            chapter["content"] = render(chapter["content"])
        except FormulaError as error:
            problems.append(f"book/src/{chapter['source_path']}: {error}")
    if problems:
        print("\n".join(problems), file=sys.stderr)
        return 1
    json.dump(book, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
