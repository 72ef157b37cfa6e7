"""GPT-2's byte-level alphabet: every byte as one printable character.

Owns: the byte <-> character table and the two conversions built on it
(`bytes_to_symbols`, `token_bytes`). Does not own: splitting text into
pre-tokens (`pretokenize.py`) or merging symbols (`bpe.py`).

Why a table at all: BPE merges work on strings, and a vocabulary file must be
text. GPT-2 maps each of the 256 byte values to one Unicode character, keeping
the printable Latin-1 bytes as themselves and shifting the other 68 (controls,
space, NBSP, soft hyphen) to U+0100 and up, in byte order. So the space byte
0x20 becomes "Ġ" (U+0120) and newline 0x0A becomes "Ċ" (U+010A); a vocabulary
entry like "Ġworld" is the bytes b" world".

Invariant: `BYTE_TO_CHAR` is a bijection of the 256 bytes onto 256 characters;
`CHAR_TO_BYTE` is its inverse.
"""

from __future__ import annotations


def _build_byte_to_char() -> list[str]:
    # Bytes that already print as themselves: '!'..'~', '¡'..'¬', '®'..'ÿ'.
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = [""] * 256
    for b in printable:
        table[b] = chr(b)
    shifted = 0
    for b in range(256):
        if not table[b]:
            # The rest get fresh code points past Latin-1, in byte order.
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


BYTE_TO_CHAR: list[str] = _build_byte_to_char()
CHAR_TO_BYTE: dict[str, int] = {c: b for b, c in enumerate(BYTE_TO_CHAR)}

# str.translate table from "a byte read as Latin-1" to its byte-level character.
# Encoding a pre-token is then `text.encode().decode("latin-1").translate(...)`,
# which runs in C instead of a Python loop over bytes.
_LATIN1_TO_SYMBOL: dict[int, str] = {b: c for b, c in enumerate(BYTE_TO_CHAR)}


def bytes_to_symbols(text: str) -> str:
    """The byte-level string of `text`: one character per UTF-8 byte."""
    return text.encode("utf-8").decode("latin-1").translate(_LATIN1_TO_SYMBOL)


# str.translate table from a byte-level character back to "its byte as Latin-1".
# Characters that are not in the alphabet but below U+0100 map to U+FFFF, so
# that the Latin-1 encode below fails for them (as for any character >= U+0100
# left untranslated) and the token is taken as plain text instead.
_SYMBOL_TO_LATIN1: dict[int, str] = {
    c: chr(CHAR_TO_BYTE[chr(c)]) if chr(c) in CHAR_TO_BYTE else "\uffff"
    for c in range(max(map(ord, BYTE_TO_CHAR)) + 1)
}


def token_bytes(token: str) -> bytes:
    """The bytes a vocabulary string stands for, as HF's ByteLevel decoder reads it.

    A token whose characters all belong to the byte alphabet maps back byte by
    byte. One that does not (an added token such as "<|im start|>" with a real
    space, or a non-ASCII one) is taken as plain UTF-8 text, which is what
    `tokenizers` does.
    """
    try:
        return token.translate(_SYMBOL_TO_LATIN1).encode("latin-1")
    except UnicodeEncodeError:
        return token.encode("utf-8")
