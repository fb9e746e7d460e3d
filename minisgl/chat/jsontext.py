"""JSON from clients, bounded before anything walks it.

Python's parser accepts deep nesting, `NaN`, `Infinity`, `1e999` and huge integers, on which
what walks the value next (templates, pydantic, `json.dumps`, `int()`) fails: a 500. So every
request body and every string a client sends as JSON passes `check_json` first, refused with a
400 naming the field. JSON is UTF-8 (RFC 8259): UTF-16/32 is refused, a UTF-8 BOM ignored.
"""

import codecs
import json
import re
from typing import Any

import numpy as np

from minisgl.limits import MAX_JSON_DEPTH, MAX_JSON_ITEMS, MAX_JSON_OBJECTS, InvalidRequestError

_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_STEPS = bytes(1 if chr(b) in "[{" else 255 if chr(b) in "]}" else 0 for b in range(256))
# Not JSON numbers (NaN, Infinity), or ones Python cannot hold: past float range (an exponent
# above 308) or past its integer-string limit (4,300 digits).
_NOT_A_NUMBER = re.compile(
    rb"NaN|Infinity|\d{4300}|[eE]\+?0*(?:[1-9]\d{3,}|[4-9]\d\d|3[1-9]\d|309)"
)
_WIDE_ENCODINGS = (codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)
MAX_FIELD_NAME_CHARS = 100  # a field named in an error


def _skeleton(raw: bytes) -> bytes:
    """`raw` with what its strings hold cut out (`""` left of each): brackets and bare words
    remain. With escaped backslashes, then escaped quotes, taken out first, the quotes left
    alternate between opening and closing a string: vectorised on that (a regex is far slower,
    holding the GIL all along: RESULTS.md section 17)."""
    unescaped = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    if not unescaped:
        return b""
    data = np.frombuffer(unescaped, dtype=np.uint8)
    quotes = data == ord('"')
    # In a string: an odd count of quotes so far (uint8 wraps at 256, an even number: the parity
    # survives the overflow).
    inside = np.cumsum(quotes, dtype=np.uint8) & 1
    return data[(inside == 0) | quotes].tobytes()


def _crowded_field(raw: bytes) -> str | None:
    """The key nearest before the middle of a body of too many items: the field that holds them
    where they make most of the body (a guess, as the body is not parsed)."""
    key_end = raw.rfind(b'":', 0, len(raw) // 2)
    key = raw[raw.rfind(b'"', 0, key_end) + 1 : key_end][:MAX_FIELD_NAME_CHARS]
    return key.decode(errors="replace") if key_end > 0 else None


def check_json(data: bytes | str, param: str = "body") -> bytes:
    """`data` as UTF-8 bytes (a leading BOM dropped); InvalidRequestError naming `param` when it
    nests deeper than MAX_JSON_DEPTH, holds more than MAX_JSON_OBJECTS objects or a number
    Python cannot represent, or is not UTF-8. Past MAX_JSON_ITEMS items it names the field
    that holds them (a 10M-id prompt: `prompt`)."""
    raw = data.encode() if isinstance(data, str) else data
    if raw.startswith(codecs.BOM_UTF8):
        raw = raw[len(codecs.BOM_UTF8) :]
    if raw.startswith(_WIDE_ENCODINGS) or b"\x00" in raw[:4]:
        raise InvalidRequestError(param, "JSON must be UTF-8 (RFC 8259)")
    skeleton = _skeleton(raw)
    brackets = skeleton.translate(None, _NOT_BRACKETS)
    # The deepest nesting: the running sum's peak, +1 per opening bracket, -1 per closing one
    # (vectorised: a Python loop is far too slow on a large body).
    steps = np.frombuffer(brackets.translate(_STEPS), dtype=np.int8)
    if brackets and steps.cumsum(dtype=np.int32).max() > MAX_JSON_DEPTH:
        raise InvalidRequestError(param, f"nests deeper than {MAX_JSON_DEPTH} levels")
    if (num_objects := brackets.count(b"{")) > MAX_JSON_OBJECTS:
        raise InvalidRequestError(param, f"holds more than {MAX_JSON_OBJECTS} objects")
    # An opening bracket or a comma starts each item (an empty container counts one).
    if skeleton.count(b",") + brackets.count(b"[") + num_objects > MAX_JSON_ITEMS:
        message = f"holds more than {MAX_JSON_ITEMS} values (array elements, object members)"
        raise InvalidRequestError(_crowded_field(raw) or param, message)
    # Without quotes, braces and colons (never inside a number, nor between two), the search
    # scans a tenth of a body of small objects.
    if _NOT_A_NUMBER.search(skeleton.translate(None, b'"{}:')):
        message = "NaN, Infinity and numbers beyond 64-bit float range are not JSON values"
        raise InvalidRequestError(param, message)
    return raw


def find_invalid_text(data: Any) -> str | None:
    """The top-level field of a JSON value holding a string that is not valid Unicode (a lone
    surrogate such as "\\ud800", which JSON escapes allow): such text cannot be encoded for
    the tokenizer or the other processes. "body" when it is not under a field (a key of the
    body); None if clean. Such a string is what UTF-8 cannot encode: JSON decodes a pair of
    surrogate escapes into one character, so a surrogate left in a string is a lone one. (A
    body nests at most MAX_JSON_DEPTH deep here: json.dumps recurses.)"""
    # The keys first: a field's name that is not valid text is no place to point at.
    fields = [("body", [*data]), *data.items()] if isinstance(data, dict) else [("body", data)]
    for where, value in fields:
        try:
            json.dumps(value, ensure_ascii=False, default=str).encode()
        except UnicodeEncodeError:
            return str(where)
    return None


def loads(text: str, param: str, invalid: str) -> Any:
    """json.loads for a string a client sent as JSON: bounded first (`check_json`: what breaks a
    bound is said as such), then InvalidRequestError(param, invalid) when it is not JSON."""
    raw = check_json(text, param)
    try:
        return json.loads(raw)
    except ValueError:
        raise InvalidRequestError(param, invalid) from None


def loads_object(text: str) -> dict[str, Any] | None:
    """The JSON object `text` holds (bounded first); None when it holds none (not JSON, past the
    bounds, another value): a model's tool-call arguments, which may be broken."""
    try:
        value = loads(text, "arguments", "not JSON")
    except ValueError:
        return None
    return value if isinstance(value, dict) else None
