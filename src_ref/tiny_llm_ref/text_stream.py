"""Text out of tokens for day 3.5's server: detokenized one token at a time, cut at stop strings.

A client of a streaming server gets text, not tokens, and a token is not text: a byte-level BPE token
can be half of a UTF-8 character, and a stop string can begin in one token and end three tokens later.
`TextStream` turns one request's tokens into the pieces its client receives; `IncrementalDetokenizer`
(Task 3) decodes a short window per token instead of everything so far; `find_stop` (Task 2) says how
much of the text not yet sent may go now.
"""

from __future__ import annotations


def find_stop(text: str, stops: list[str]) -> tuple[int, bool]:
    """How much of `text` may be sent to the client now, and whether a stop string was found.

    Returns `(end, stopped)`. If a stop string occurs in `text`, `end` is where the earliest one starts
    and `stopped` is True: the client gets `text[:end]`, never the stop string itself. Otherwise `end`
    holds back the longest tail of `text` that is the beginning of some stop string (the next tokens
    may complete it), and `stopped` is False.
    """
    # BEGIN TASK Week 3 Day 5 Task 2: stop strings
    # TODO: the earliest occurrence of any stop; else hold back the longest tail that begins a stop
    found = [index for index in (text.find(stop) for stop in stops) if index >= 0]
    if found:
        return min(found), True
    held_back = 0
    for stop in stops:
        # The longest k < len(stop) such that text ends with stop[:k].
        for k in range(min(len(stop) - 1, len(text)), held_back, -1):
            if text.endswith(stop[:k]):
                held_back = k
                break
    return len(text) - held_back, False
    # END TASK


class IncrementalDetokenizer:
    """Text from tokens one token at a time, decoding a short window instead of the whole output.

    Decoding all the tokens again after each one costs O(n) per token, O(n^2) per stream. Instead,
    keep two offsets into `tokens`: `read_offset`, the end of what was already turned into text, and
    `prefix_offset`, a little before it, so the window decoded has the context some tokenizers need
    (a SentencePiece token's leading space depends on the token before it). The new text is the
    window's decoding minus the decoding of its already-read part. A token that ends inside a
    multi-byte character decodes to a trailing U+FFFD: nothing is returned until the next tokens
    complete the character.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.prefix_offset = 0  # where the decoded window starts
        self.read_offset = 0  # tokens before this have been returned as text

    def add(self, token: int) -> str:
        """The text `token` completes (often one word piece; empty while a character is incomplete)."""
        # BEGIN TASK Week 3 Day 5 Task 3: incremental detokenization
        # TODO: append; decode tokens[prefix_offset:read_offset] and tokens[prefix_offset:]; if the window
        # TODO: grew and does not end in U+FFFD, move both offsets forward and return the new text
        self.tokens.append(token)
        already = self.tokenizer.decode(self.tokens[self.prefix_offset:self.read_offset])
        window = self.tokenizer.decode(self.tokens[self.prefix_offset:])
        if len(window) <= len(already) or window.endswith("\ufffd"):
            return ""  # the token ended inside a character (or added no text yet): wait for the next ones
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        return window[len(already):]
        # END TASK

    def flush(self) -> str:
        """At the end of the stream: whatever is still held back, as `tokenizer.decode` renders it (provided)."""
        already = self.tokenizer.decode(self.tokens[self.prefix_offset:self.read_offset])
        window = self.tokenizer.decode(self.tokens[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.tokens)
        return window[len(already):]


class TextStream:
    """Turns one request's tokens into the text pieces its client receives: detokenized, cut at stop strings.

    The pieces add up to what `tokenizer.decode` gives for all the tokens, cut before the first stop
    string. Only the text not yet sent is searched for stop strings: `find_stop` never lets a piece
    end with the beginning of a stop string, so a stop cannot straddle what was sent (provided).
    """

    def __init__(self, tokenizer, stops: list[str]):
        self.detokenizer = IncrementalDetokenizer(tokenizer)
        self.eos_token_ids = set(tokenizer.eos_token_ids)
        self.stops = stops
        self.pending = ""  # text decoded but not sent: it may be the beginning of a stop string
        self.stopped = False  # a stop string was found: the request is over

    def add(self, token: int | None, finished: bool) -> str:
        """The new piece of text after `token` (may be empty); at `finished`, everything still held back."""
        if token is not None and token not in self.eos_token_ids:
            self.pending += self.detokenizer.add(token)
        if finished:
            self.pending += self.detokenizer.flush()
        end, self.stopped = find_stop(self.pending, self.stops)
        if finished and not self.stopped:
            end = len(self.pending)  # nothing more can complete a stop string
        piece, self.pending = self.pending[:end], self.pending[end:]
        return piece
