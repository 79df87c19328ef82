"""Structured outputs: a JSON Schema compiled to a byte automaton, and a mask of allowed tokens per state.

Three steps, one per task:

1. `compile_schema`: the schema becomes a nondeterministic automaton over bytes (an NFA, built here
   fragment by fragment as Thompson's construction builds one from a regular expression), which
   `Automaton` determinizes lazily: a DFA state is the set of NFA states the bytes so far can reach,
   made the first time some walk needs it. Bounded JSON (no recursive `$ref`, nesting depth fixed)
   is a regular language, so a finite automaton is enough; a recursive schema would need a stack.
2. `TokenIndex.mask`: for one automaton state, the tokens whose bytes all keep the automaton alive
   (walked byte by byte, down the vocabulary's trie: byte-level BPE tokens can split a UTF-8 character),
   plus the end-of-sequence token when the state accepts. Built the first time a state is met and cached.
3. `constraint_state` and `apply_constraints`: in week 3's step, each constrained sequence's state
   after its output so far, and one masked `mx.where` over the constrained rows before sampling.

With day 4.1's speculation (provided, on top of Task 3): a proposal is cut at the first guess the mask
refuses (`allowed_guesses`), and each row of a verify chunk is masked for the state its guesses reach
(`constrain_guess_rows`), so the accepted tokens stay inside the schema.
"""

from __future__ import annotations

import bisect
import functools
import json
from typing import NamedTuple

import mlx.core as mx
import numpy as np

# Whitespace between two JSON tokens: at most one space, as json.dumps writes (", " and ": ") or not at all
# (compact). A looser rule is still valid JSON, but a model that likes padding then spends its tokens (and
# the index its masks: each count of spaces is a state of its own) on whitespace.
MAX_WHITESPACE = 1
JSON_OBJECT_DEPTH = 3  # nesting allowed by {"type": "json_object"} (a bound keeps it a finite automaton)
ANNOTATIONS = {"title", "description", "default", "examples", "$schema", "$id", "$comment"}  # ignored
SUPPORTED = {"type", "properties", "required", "additionalProperties", "items", "minItems", "maxItems",
             "enum", "const", "minLength", "maxLength", "anyOf", "$ref", "$defs", "definitions"} | ANNOTATIONS
WHITESPACE = b" "
MAX_COUNT = 256  # the largest minLength/maxLength/minItems/maxItems served: each count is a copy in the NFA
DEAD = 0  # the automaton state no bytes lead out of: the empty set of NFA states
UNKNOWN = -1  # in `Automaton.table`, a row not filled yet (its state not expanded)


# ---------------------------------------------------------------- the NFA and its lazy DFA (provided)


class Nfa:
    """A byte NFA built by appending fragments: each builder takes a start state and returns its end state."""

    def __init__(self):
        self.edges: list[list[tuple[int, int, int]]] = []  # per state: (lowest byte, highest byte, target)
        self.eps: list[list[int]] = []  # per state: targets reached without reading a byte

    def state(self) -> int:
        """A new state with no edges."""
        self.edges.append([])
        self.eps.append([])
        return len(self.edges) - 1

    def epsilon(self, src: int, dst: int) -> None:
        self.eps[src].append(dst)

    def byte_range(self, src: int, lo: int, hi: int, dst: int | None = None) -> int:
        """An edge on any byte in lo..hi from `src` to `dst` (a new state if None); returns `dst`."""
        dst = self.state() if dst is None else dst
        self.edges[src].append((lo, hi, dst))
        return dst

    def byte_set(self, src: int, allowed: bytes) -> int:
        """Edges on each byte of `allowed` to one new state."""
        dst = self.state()
        for b in allowed:
            self.byte_range(src, b, b, dst)
        return dst

    def literal(self, src: int, data: bytes) -> int:
        """The bytes of `data` one after the other."""
        for b in data:
            src = self.byte_range(src, b, b)
        return src

    def choice(self, src: int, builders) -> int:
        """Any one of `builders` (each a function start -> end) from `src`, joined at one end state."""
        end = self.state()
        for build in builders:
            self.epsilon(build(src), end)
        return end

    def repeat(self, src: int, build, low: int, high: int | None) -> int:
        """`build` between `low` and `high` times (no upper bound when `high` is None)."""
        end = self.state()
        for count in range(low if high is None else high):
            if count >= low:
                self.epsilon(src, end)
            src = build(src)
        if high is None:
            # A loop on a state of its own, so the way back cannot reach another branch leaving `src`.
            head = self.state()
            self.epsilon(src, head)
            self.epsilon(build(head), head)
            src = head
        self.epsilon(src, end)
        return end

    def closure(self, states) -> frozenset[int]:
        """Every state reachable from `states` without reading a byte."""
        seen, todo = set(states), list(states)
        while todo:
            for nxt in self.eps[todo.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return frozenset(seen)


class Automaton:
    """The DFA of an NFA, made lazily: state ids index `table`, a (capacity x 256) array of successors
    (UNKNOWN in the rows of states not expanded yet)."""

    def __init__(self, nfa: Nfa, start: int, accept: int):
        self.nfa = nfa
        self.accept = accept
        self.sets: list[frozenset[int]] = [frozenset()]  # DEAD first
        self.ids: dict[frozenset[int], int] = {frozenset(): DEAD}
        self.table = np.full((64, 256), UNKNOWN, dtype=np.int32)
        self.table[DEAD] = DEAD  # every byte leads from DEAD to DEAD
        self.expanded = np.zeros(64, dtype=bool)
        self.expanded[DEAD] = True
        self.start = self.state_of(nfa.closure([start]))

    def state_of(self, nfa_states: frozenset[int]) -> int:
        """The DFA id of a set of NFA states, made if new."""
        if nfa_states not in self.ids:
            self.ids[nfa_states] = len(self.sets)
            self.sets.append(nfa_states)
            if len(self.sets) > len(self.expanded):  # grow the table by doubling
                self.table = np.concatenate([self.table, np.full_like(self.table, UNKNOWN)])
                self.expanded = np.concatenate([self.expanded, np.zeros_like(self.expanded)])
        return self.ids[nfa_states]

    def expand(self, state: int) -> None:
        """Fill `state`'s row of `table`: its successor on every byte."""
        if self.expanded[state]:
            return
        edges = [edge for nfa_state in self.sets[state] for edge in self.nfa.edges[nfa_state]]
        # The bytes between two consecutive range ends share every edge's verdict: one target set per stretch.
        cuts = sorted({lo for lo, _, _ in edges} | {hi + 1 for _, hi, _ in edges})
        targets: list[set[int]] = [set() for _ in cuts]  # of the stretch cuts[i] .. cuts[i + 1] - 1
        for lo, hi, dst in edges:
            for stretch in range(bisect.bisect_left(cuts, lo), bisect.bisect_left(cuts, hi + 1)):
                targets[stretch].add(dst)
        row = np.full(256, DEAD, dtype=np.int32)
        made: dict[frozenset[int], int] = {}  # stretches with the same targets share one closure
        for stretch, dst in enumerate(targets):
            if dst:
                key = frozenset(dst)
                if key not in made:
                    made[key] = self.state_of(self.nfa.closure(key))
                row[cuts[stretch]:cuts[stretch + 1]] = made[key]
        self.table[state] = row  # after state_of, which may have grown the table
        self.expanded[state] = True

    def expand_all(self, states: np.ndarray) -> None:
        """Expand every state in `states` not expanded yet."""
        for state in np.unique(states[~self.expanded[states]]):
            self.expand(int(state))

    def successors_of(self, states: np.ndarray, labels: np.ndarray) -> np.ndarray:
        """The state after byte `labels[i]` from `states[i]`, for every i at once; states met for the first time
        are expanded (a row still UNKNOWN shows them: one check, not a look-up per state)."""
        found = self.table.reshape(-1).take(states * 256 + labels)
        if found.min() == UNKNOWN:
            self.expand_all(states[found == UNKNOWN])
            found = self.table.reshape(-1).take(states * 256 + labels)  # the table may have grown: read it again
        return found

    def step(self, state: int, byte: int) -> int:
        self.expand(state)
        return int(self.table[state, byte])

    def successors(self, state: int) -> list[int]:
        """The state after each of the 256 bytes (DEAD where a byte is not allowed)."""
        self.expand(state)
        return self.table[state].tolist()

    def explore(self, limit: int = 20_000) -> tuple[np.ndarray, np.ndarray]:
        """Expand every state reachable from the start: (successor table, accepting flags), one row per state.

        For a caller that walks the automaton many times (a test, a lab): one answer instead of a call per byte.
        """
        todo, seen = [self.start], {DEAD, self.start}
        while todo:
            state = todo.pop()
            self.expand(state)
            for nxt in set(self.table[state].tolist()) - seen:
                seen.add(nxt)
                todo.append(nxt)
            if len(seen) > limit:
                raise ValueError(f"more than {limit} automaton states")
        accepting = np.array([self.accepts(state) for state in range(len(self.sets))])
        return self.table[:len(self.sets)].copy(), accepting

    def walk(self, state: int, data: bytes) -> int:
        """The state after reading `data` from `state` (DEAD once a byte is not allowed)."""
        for b in data:
            state = self.step(state, b)
            if state == DEAD:
                break
        return state

    def accepts(self, state: int) -> bool:
        return self.accept in self.sets[state]

    def is_complete(self, state: int) -> bool:
        """Accepting, and no byte may follow: the output is finished."""
        self.expand(state)
        return self.accepts(state) and not self.table[state].any()

    def matches(self, data: bytes) -> bool:
        """Whether the automaton accepts exactly `data`."""
        return self.accepts(self.walk(self.start, data))


# ---------------------------------------------------------------- JSON's lexical pieces (provided)


def whitespace(nfa: Nfa, src: int) -> int:
    """Up to MAX_WHITESPACE spaces (a bound, so a model cannot pad forever)."""
    return nfa.repeat(src, lambda s: nfa.byte_set(s, WHITESPACE), 0, MAX_WHITESPACE)


def string_char(nfa: Nfa, src: int) -> int:
    """One character of a JSON string: printable ASCII but quote and backslash, an escape, or a UTF-8 sequence."""
    end = nfa.state()
    nfa.byte_range(src, 0x20, 0x21, end)  # the quote is 0x22
    nfa.byte_range(src, 0x23, 0x5B, end)  # the backslash is 0x5C
    nfa.byte_range(src, 0x5D, 0x7F, end)
    escape = nfa.byte_range(src, 0x5C, 0x5C)
    for b in b'"\\/bfnrt':
        nfa.byte_range(escape, b, b, end)
    hex_digit = nfa.byte_range(escape, ord("u"), ord("u"))
    for _ in range(4):
        nxt = nfa.state()
        for lo, hi in ((0x30, 0x39), (0x41, 0x46), (0x61, 0x66)):
            nfa.byte_range(hex_digit, lo, hi, nxt)
        hex_digit = nxt
    nfa.epsilon(hex_digit, end)
    # Well-formed UTF-8 (RFC 3629's table): a lead byte, then continuation bytes 80..BF, some narrowed.
    for lead, second, tail in (((0xC2, 0xDF), (0x80, 0xBF), 0), ((0xE0, 0xE0), (0xA0, 0xBF), 1),
                               ((0xE1, 0xEC), (0x80, 0xBF), 1), ((0xED, 0xED), (0x80, 0x9F), 1),
                               ((0xEE, 0xEF), (0x80, 0xBF), 1), ((0xF0, 0xF0), (0x90, 0xBF), 2),
                               ((0xF1, 0xF3), (0x80, 0xBF), 2), ((0xF4, 0xF4), (0x80, 0x8F), 2)):
        state = nfa.byte_range(nfa.byte_range(src, *lead), *second)
        for _ in range(tail):
            state = nfa.byte_range(state, 0x80, 0xBF)
        nfa.epsilon(state, end)
    return end


def string(nfa: Nfa, src: int, min_length: int = 0, max_length: int | None = None) -> int:
    """A JSON string of `min_length` .. `max_length` characters (an escape is one character)."""
    src = nfa.literal(src, b'"')
    src = nfa.repeat(src, lambda s: string_char(nfa, s), min_length, max_length)
    return nfa.literal(src, b'"')


def digits(nfa: Nfa, src: int) -> int:
    """One digit or more."""
    return nfa.repeat(src, lambda s: nfa.byte_range(s, 0x30, 0x39), 1, None)


def integer(nfa: Nfa, src: int) -> int:
    """-?(0|[1-9][0-9]*), JSON's integer."""
    sign = nfa.state()
    nfa.epsilon(src, sign)
    nfa.byte_range(src, ord("-"), ord("-"), sign)
    end = nfa.byte_range(sign, ord("0"), ord("0"))
    nfa.epsilon(nfa.repeat(nfa.byte_range(sign, ord("1"), ord("9")),
                           lambda s: nfa.byte_range(s, 0x30, 0x39), 0, None), end)
    return end


def number(nfa: Nfa, src: int) -> int:
    """An integer, then optionally a fraction and an exponent."""
    end = nfa.state()
    whole = integer(nfa, src)
    nfa.epsilon(whole, end)
    fraction = digits(nfa, nfa.literal(whole, b"."))
    nfa.epsilon(fraction, end)
    for before in (whole, fraction):
        e = nfa.byte_set(before, b"eE")
        signed = nfa.state()
        nfa.epsilon(e, signed)
        nfa.epsilon(nfa.byte_set(e, b"+-"), signed)
        nfa.epsilon(digits(nfa, signed), end)
    return end


def encodings(value) -> list[bytes]:
    """How an enum or const scalar is written: json.dumps with raw UTF-8 (one form: the model cannot wander
    into \\u escapes of a value it must copy; a free string still takes escapes)."""
    if isinstance(value, (dict, list)):
        raise ValueError("enum and const values must be strings, numbers, booleans or null")
    return [json.dumps(value, ensure_ascii=False).encode()]


def literals(nfa: Nfa, src: int, values) -> int:
    """Any one of `values` written as JSON."""
    options = [data for value in values for data in encodings(value)]
    return nfa.choice(src, [functools.partial(nfa.literal, data=data) for data in options])


def options(schema: dict, name: str) -> list:
    """`schema[name]` (enum, anyOf), checked: a non-empty list (an empty one allows nothing), else ValueError naming it."""
    value = schema[name]
    if not isinstance(value, list) or not value:
        raise ValueError(f"'{name}' must be a non-empty list, got {value!r}")
    return value


def bounds(schema: dict, low_name: str, high_name: str) -> tuple[int, int | None]:
    """(low, high) of a length or item count: each checked by `count`, low <= high (else nothing is allowed)."""
    low, high = count(schema, low_name, 0), count(schema, high_name, None)
    if high is not None and low > high:
        raise ValueError(f"'{low_name}' ({low}) is more than '{high_name}' ({high}): nothing would be allowed")
    return low, high


def count(schema: dict, name: str, default: int | None) -> int | None:
    """`schema[name]` (a length or item bound), checked: an integer in 0 .. MAX_COUNT, else ValueError naming it."""
    value = schema.get(name, default)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_COUNT):
        raise ValueError(f"'{name}' must be an integer in 0 .. {MAX_COUNT}, got {value!r}")
    return value


# ---------------------------------------------------------------- Task 1: the schema compiler


class SchemaCompiler:
    """Compiles one JSON Schema (its `$defs` for `$ref`) into an `Nfa`."""

    def __init__(self, root: dict):
        self.root = root
        self.nfa = Nfa()
        self.resolving: list[str] = []  # the `$ref`s being expanded: one seen twice is recursion

    def compile(self) -> Automaton:
        """The DFA of the whole schema: the value alone, no whitespace around it."""
        start = self.nfa.state()
        accept = self.value(self.root, start)
        return Automaton(self.nfa, start, accept)

    def value(self, schema, src: int) -> int:
        """Any JSON value `schema` allows, from `src`; returns the end state."""
        # BEGIN TASK Week 4 Day 5 Task 1: compile one schema node
        # TODO: refuse unknown keywords (ValueError naming one); {} or True: any value; then $ref, enum, const,
        # TODO: anyOf, a list of types, and each type: object, array, string, integer, number, boolean, null
        if schema is True or schema == {}:
            return any_value(self.nfa, src, JSON_OBJECT_DEPTH)
        if not isinstance(schema, dict):
            raise ValueError(f"a schema must be an object, got {schema!r}")
        unknown = sorted(set(schema) - SUPPORTED)
        if unknown:
            raise ValueError(f"unsupported JSON Schema keyword {unknown[0]!r}")
        if "$ref" in schema:
            return self.reference(schema["$ref"], src)
        if "enum" in schema:
            return literals(self.nfa, src, options(schema, "enum"))
        if "const" in schema:
            return literals(self.nfa, src, [schema["const"]])
        if "anyOf" in schema:
            return self.nfa.choice(src, [functools.partial(self.value, option) for option in options(schema, "anyOf")])
        kind = schema.get("type")
        if isinstance(kind, list):
            options(schema, "type")
            return self.nfa.choice(src, [functools.partial(self.value, {**schema, "type": t}) for t in kind])
        if kind == "object":
            return self.object(schema, src)
        if kind == "array":
            return self.array(schema, src)
        if kind == "string":
            return string(self.nfa, src, *bounds(schema, "minLength", "maxLength"))
        if kind == "integer":
            return integer(self.nfa, src)
        if kind == "number":
            return number(self.nfa, src)
        if kind == "boolean":
            return literals(self.nfa, src, [True, False])
        if kind == "null":
            return self.nfa.literal(src, b"null")
        raise ValueError(f"unsupported JSON Schema type {kind!r}")
        # END TASK

    def reference(self, ref: str, src: int) -> int:
        """The schema `ref` names (`#/$defs/Name` or `#/definitions/Name`), expanded in place."""
        # BEGIN TASK Week 4 Day 5 Task 1: expand a $ref
        # TODO: look the name up under $defs or definitions; a ref already being expanded is recursion: ValueError
        parts = ref.split("/")
        if len(parts) != 3 or parts[0] != "#" or parts[1] not in ("$defs", "definitions"):
            raise ValueError(f"unsupported $ref {ref!r}: only #/$defs/<name> is served")
        target = self.root.get(parts[1], {}).get(parts[2])
        if target is None:
            raise ValueError(f"$ref {ref!r} names no definition")
        if ref in self.resolving:
            raise ValueError(f"recursive $ref {ref!r}: a recursive schema needs a pushdown automaton")
        self.resolving.append(ref)
        end = self.value(target, src)
        self.resolving.pop()
        return end
        # END TASK

    def object(self, schema: dict, src: int) -> int:
        """`{` the declared properties in order, the required ones always, `}`; no others."""
        # BEGIN TASK Week 4 Day 5 Task 1: an object with properties in declared order
        # TODO: additionalProperties must be absent or false; per property i two states: nothing written yet /
        # TODO: something written (then a comma first); an optional property may be skipped; close after the last
        nfa = self.nfa
        if schema.get("additionalProperties", False) is not False:
            raise ValueError("unsupported JSON Schema keyword 'additionalProperties' (only false is served)")
        properties = schema.get("properties", {})
        required = set(schema.get("required", []))
        missing = required - set(properties)
        if missing:
            raise ValueError(f"required property {sorted(missing)[0]!r} is not among the properties")
        none = whitespace(nfa, nfa.literal(src, b"{"))  # nothing written yet
        some = None  # something written: the next property needs a comma (None: not reachable yet)
        for name, sub in properties.items():
            member = nfa.state()  # where the key starts, from either side
            nfa.epsilon(none, member)
            if some is not None:
                nfa.epsilon(whitespace(nfa, nfa.literal(whitespace(nfa, some), b",")), member)
            key = literals(nfa, member, [name])
            written = self.value(sub, whitespace(nfa, nfa.literal(whitespace(nfa, key), b":")))
            if name in required:
                none, some = nfa.state(), written  # `none` gets no edge in: unreachable from here on
            else:
                if some is not None:
                    nfa.epsilon(some, written)  # skipped after something was written
                some = written
        end = nfa.state()
        nfa.epsilon(nfa.literal(none, b"}"), end)
        if some is not None:
            nfa.epsilon(nfa.literal(whitespace(nfa, some), b"}"), end)
        return end
        # END TASK

    def array(self, schema: dict, src: int) -> int:
        """`[` between minItems and maxItems items, separated by commas, `]`."""
        # BEGIN TASK Week 4 Day 5 Task 1: an array of bounded length
        # TODO: the first item follows "[", each next one a comma; close once minItems are written
        nfa = self.nfa
        items = schema.get("items", {})
        low, high = bounds(schema, "minItems", "maxItems")
        opened = whitespace(nfa, nfa.literal(src, b"["))
        end = nfa.state()
        if low == 0:
            nfa.epsilon(nfa.literal(opened, b"]"), end)
        if high == 0:
            return end
        first = self.value(items, opened)

        def another(state: int) -> int:
            return self.value(items, whitespace(nfa, nfa.literal(whitespace(nfa, state), b",")))

        written = nfa.repeat(first, another, max(low - 1, 0), None if high is None else high - 1)
        nfa.epsilon(nfa.literal(whitespace(nfa, written), b"]"), end)
        return end
        # END TASK


def any_value(nfa: Nfa, src: int, depth: int) -> int:
    """Any JSON value nested at most `depth` deep (provided: `{"type": "json_object"}` and `{}`)."""
    builders = [functools.partial(string, nfa), functools.partial(number, nfa),
                functools.partial(literals, nfa, values=[True, False, None])]
    if depth > 0:
        builders += [functools.partial(any_object, nfa, depth=depth - 1), functools.partial(any_array, nfa, depth=depth - 1)]
    return nfa.choice(src, builders)


def any_object(nfa: Nfa, src: int, depth: int) -> int:
    """An object of any string keys, values nested at most `depth` deeper."""
    def member(state: int) -> int:
        key = whitespace(nfa, string(nfa, whitespace(nfa, state)))
        return whitespace(nfa, any_value(nfa, whitespace(nfa, nfa.literal(key, b":")), depth))

    return sequence_of(nfa, src, b"{", member, b"}")


def any_array(nfa: Nfa, src: int, depth: int) -> int:
    """An array of any values nested at most `depth` deeper."""
    return sequence_of(nfa, src, b"[", lambda s: whitespace(nfa, any_value(nfa, whitespace(nfa, s), depth)), b"]")


def sequence_of(nfa: Nfa, src: int, opening: bytes, element, closing: bytes) -> int:
    """`opening`, any number of `element` separated by commas, `closing` (each element brings its whitespace)."""
    opened = nfa.literal(src, opening)
    end = nfa.state()
    nfa.epsilon(nfa.literal(whitespace(nfa, opened), closing), end)
    written = nfa.repeat(element(opened), lambda s: element(nfa.literal(s, b",")), 0, None)
    nfa.epsilon(nfa.literal(written, closing), end)
    return end


def compile_schema(schema) -> Automaton:
    """The automaton of the JSON texts `schema` allows (compact or spaced, properties in declared order)."""
    return SchemaCompiler(schema).compile()


def json_object_automaton() -> Automaton:
    """OpenAI's `{"type": "json_object"}`: any JSON object nested at most JSON_OBJECT_DEPTH deep."""
    nfa = Nfa()
    start = nfa.state()
    return Automaton(nfa, start, any_object(nfa, start, JSON_OBJECT_DEPTH - 1))


# ---------------------------------------------------------------- the vocabulary as bytes (provided)


def gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: each of the 256 bytes is one printable character in a token's text."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class TrieLevel(NamedTuple):
    """The nodes of the vocabulary's trie at one depth: each is a distinct prefix of the tokens, that many bytes long."""

    parents: np.ndarray  # per node: its prefix one byte shorter (an index into the level above; the root is 0)
    labels: np.ndarray  # per node: its last byte
    tokens: np.ndarray  # the tokens exactly this long ...
    ends: np.ndarray  # ... and the node each of them ends at


class Vocabulary:
    """Every token's bytes as a trie stored level by level, for a walk of the whole vocabulary at once.

    Tokens that share a prefix share its nodes, so a walk reads each shared prefix once: Qwen2's 151,643
    tokens hold 976,000 bytes but only 333,000 distinct prefixes. `levels[d]` holds the prefixes d + 1 bytes long.
    A special token (no bytes) is never allowed, but an end-of-sequence one in an accepting state.
    """

    def __init__(self, token_bytes: list[bytes | None], eos_token_ids, size: int):
        self.token_bytes = list(token_bytes) + [None] * (size - len(token_bytes))
        self.eos_token_ids = sorted(eos_token_ids)
        self.size = size
        self.levels: list[TrieLevel] = []
        above = {b"": 0}  # the level above: prefix -> node index (the root alone to start)
        longer = [token for token, data in enumerate(self.token_bytes) if data]  # tokens that reach this level
        while longer:
            length = len(self.levels) + 1
            nodes: dict[bytes, int] = {}
            for token in longer:
                nodes.setdefault(self.token_bytes[token][:length], len(nodes))
            ending = [token for token in longer if len(self.token_bytes[token]) == length]
            self.levels.append(TrieLevel(
                parents=np.array([above[prefix[:-1]] for prefix in nodes], dtype=np.int32),
                labels=np.array([prefix[-1] for prefix in nodes], dtype=np.uint8),
                tokens=np.array(ending, dtype=np.int64),
                ends=np.array([nodes[self.token_bytes[token]] for token in ending], dtype=np.int32)))
            above = nodes
            longer = [token for token in longer if len(self.token_bytes[token]) > length]


@functools.lru_cache(maxsize=4)
def tokenizer_vocabulary(tokenizer, size: int) -> Vocabulary:
    """The `Vocabulary` of a byte-level BPE tokenizer (Qwen2's, SmolLM2's), `size` wide (the model's logits)."""
    decoder = gpt2_byte_decoder()
    added = tokenizer.added_tokens_decoder  # id -> AddedToken: written as they are, or special
    vocab = tokenizer.get_vocab()
    token_bytes: list[bytes | None] = [None] * (max(vocab.values()) + 1)
    for text, token in vocab.items():
        if token in added:
            token_bytes[token] = None if added[token].special else added[token].content.encode()
        else:
            token_bytes[token] = bytes(decoder[c] for c in text)
    return Vocabulary(token_bytes[:size], tokenizer.eos_token_ids, size)


# ---------------------------------------------------------------- Task 2: a mask of allowed tokens per state


class TokenIndex:
    """The allowed tokens of each automaton state, computed the first time the state is met, then cached."""

    def __init__(self, automaton: Automaton, vocabulary: Vocabulary):
        self.automaton = automaton
        self.vocabulary = vocabulary
        self.masks: dict[int, mx.array] = {}  # state -> bool (vocabulary.size,)

    def mask(self, state: int) -> mx.array:
        """Bool (V,): the tokens whose every byte keeps the automaton alive from `state`; EOS when it accepts."""
        if state not in self.masks:
            self.masks[state] = self.build(state)
        return self.masks[state]

    def build(self, state: int) -> mx.array:
        """The mask of `state`, walked over the vocabulary's trie one level (one byte position) at a time."""
        # BEGIN TASK Week 4 Day 5 Task 2: the allowed tokens of one state
        # TODO: the root starts at `state`; level by level, each node's state is its parent's moved by its label
        # TODO: (automaton.successors_of(parent states, labels)); a token is allowed if its end node is not DEAD;
        # TODO: stop once every node is DEAD; EOS only if the state accepts
        vocab, automaton = self.vocabulary, self.automaton
        allowed = np.zeros(vocab.size, dtype=bool)
        states = np.array([state], dtype=np.int32)  # the root: no byte read yet
        for level in vocab.levels:
            states = automaton.successors_of(states.take(level.parents), level.labels)
            allowed[level.tokens] = states.take(level.ends) != DEAD
            if not states.any():  # every longer token starts with a prefix that is already dead
                break
        if automaton.accepts(state):
            allowed[vocab.eos_token_ids] = True
        return mx.array(allowed)
        # END TASK


class Constraint:
    """What a request's output must match: its automaton and that automaton's token index (one per schema)."""

    def __init__(self, automaton: Automaton, vocabulary: Vocabulary):
        self.automaton = automaton
        self.vocabulary = vocabulary
        self.index = TokenIndex(automaton, vocabulary)

    @property
    def start(self) -> int:
        return self.automaton.start

    def next_state(self, state: int, token: int) -> int:
        """The state after `token`'s bytes (DEAD for a token with none, such as a special token)."""
        data = self.vocabulary.token_bytes[token]
        return DEAD if data is None else self.automaton.walk(state, data)

    def is_complete(self, state: int) -> bool:
        """The output is finished: accepted, and nothing may follow."""
        return self.automaton.is_complete(state)


def make_constraint(schema, tokenizer, vocab_size: int) -> Constraint:
    """A `Constraint` for a JSON Schema (or "json_object": any JSON object) against `tokenizer`'s tokens."""
    automaton = json_object_automaton() if schema == "json_object" else compile_schema(schema)
    return Constraint(automaton, tokenizer_vocabulary(tokenizer, vocab_size))


# ---------------------------------------------------------------- Task 3: in the engine's step


def constraint_state(seq) -> int:
    """The automaton state of a constrained `seq` after all its output tokens.

    `seq.constraint_progress` remembers (tokens consumed, state) so each step reads only the new token;
    a preempted sequence keeps its output tokens, so its state stays right when it is recomputed.
    """
    # BEGIN TASK Week 4 Day 5 Task 3: the state after the output so far
    # TODO: start from seq.constraint_progress (or (0, start)); next_state over the output tokens not consumed yet; store
    constraint = seq.sampling.constraint
    consumed, state = seq.constraint_progress or (0, constraint.start)
    for token in seq.output_token_ids[consumed:]:
        state = constraint.next_state(state, token)
    seq.constraint_progress = (len(seq.output_token_ids), state)
    return state
    # END TASK


def apply_constraints(logits: mx.array, seqs: list) -> mx.array:
    """`logits` (one row per sequence) with -inf on each constrained row's forbidden tokens; `logits` when none is."""
    rows = [row for row, seq in enumerate(seqs) if seq.sampling.constraint is not None]
    if not rows:  # provided: a step without constraints (every step before this day) costs nothing
        return logits
    # BEGIN TASK Week 4 Day 5 Task 3: mask the constrained rows
    # TODO: stack the rows' masks (index.mask(constraint_state(seq))), check their width against the logits,
    # TODO: and write mx.where(mask, row, -inf) into a copy of `logits`, those rows only
    allowed = mx.stack([seqs[row].sampling.constraint.index.mask(constraint_state(seqs[row])) for row in rows])
    if allowed.shape[-1] != logits.shape[-1]:
        raise ValueError(f"a constraint built for {allowed.shape[-1]} tokens, the model has {logits.shape[-1]}")
    picked = mx.array(rows, dtype=mx.int32)
    masked = mx.array(logits)  # a copy: the raw rows stay as they are, for the log-probabilities
    masked[picked] = mx.where(allowed, logits[picked], mx.array(-mx.inf, dtype=logits.dtype))
    return masked
    # END TASK


def is_complete(seq) -> bool:
    """A constrained `seq` whose output is finished: accepted with nothing allowed after (provided)."""
    constraint = seq.sampling.constraint
    return constraint is not None and constraint.is_complete(constraint_state(seq))


# ---------------------------------------------------------------- with day 4.1's speculation (provided)


def allowed_guesses(seq, draft: list[int]) -> list[int]:
    """The guesses of `draft` up to the first one the mask refuses (provided).

    Each guess is checked against the mask of the state the output and the guesses before it reach: a
    guess the constraint refuses can never be accepted (its row's mask refuses it too), so verifying it and
    every guess after it would be wasted. Unconstrained sequences keep their whole draft.
    """
    constraint = seq.sampling.constraint
    if constraint is None:
        return draft
    state = constraint_state(seq)
    for at, token in enumerate(draft):
        if not constraint.index.mask(state)[token].item():
            return draft[:at]
        state = constraint.next_state(state, token)
    return draft


def constrain_guess_rows(logits: mx.array, seq, draft: list[int]) -> mx.array:
    """A verify chunk's `1 + len(draft)` rows of logits, row i masked for the state after the output and the
    first i guesses (provided): the target's token at each row is then what a constrained step would pick.

    The draft went through `allowed_guesses`, so every state is alive but the one after an EOS guess, which
    ends the sequence: that row is never read and stays as it is.
    """
    constraint = seq.sampling.constraint
    if constraint is None:
        return logits
    states = [constraint_state(seq)]
    for token in draft:
        states.append(constraint.next_state(states[-1], token))
    everything = mx.ones(logits.shape[-1], dtype=mx.bool_)
    allowed = mx.stack([everything if state == DEAD else constraint.index.mask(state) for state in states])
    return mx.where(allowed, logits, mx.array(-mx.inf, dtype=logits.dtype))
