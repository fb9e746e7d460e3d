"""docs/server.md#limits lists every bound of the table in minisgl/limits.py, with its value."""

import ast
import re
from pathlib import Path

from minisgl import limits

ROOT = Path(__file__).resolve().parents[1]
TABLE_START, TABLE_END = "# ---- The table", "# ----------"


def table_names() -> list[str]:
    """The names assigned between the table's two marker comments of minisgl/limits.py."""
    source = Path(limits.__file__).read_text()
    table = source.split(TABLE_START, 1)[1].split("\n", 1)[1].split(TABLE_END, 1)[0]
    names = []
    for node in ast.parse(table).body:
        assert isinstance(node, ast.Assign), ast.unparse(node)
        for target in node.targets:
            elements = target.elts if isinstance(target, ast.Tuple) else [target]
            names += [e.id for e in elements if isinstance(e, ast.Name)]
    return names


def documented() -> dict[str, str]:
    """`NAME` -> the Value cell of each row of docs/server.md's Limits table."""
    text = (ROOT / "docs" / "server.md").read_text()
    section = text.split("\n## Limits\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([A-Z0-9_]+)` \| ([^|]+) \|", section, flags=re.MULTILINE)
    return {name: value.strip() for name, value in rows}


def test_every_bound_is_documented_with_its_value():
    names, docs = table_names(), documented()
    assert len(names) > 20, names  # the parse found the table
    for name in names:
        value = getattr(limits, name)
        assert name in docs, f"{name} is missing from docs/server.md#limits"
        expected = f"{value:g}" if isinstance(value, float) else str(value)
        assert docs[name] == expected, name
    assert set(docs) == set(names), set(docs) - set(names)


def test_the_table_is_what_the_code_reads():
    """The flags' defaults and SamplingParams' default come from the table."""
    from minisgl.config import ServerArgs
    from minisgl.core import SamplingParams

    args = ServerArgs()
    assert args.max_sequences_per_request == limits.DEFAULT_MAX_SEQUENCES_PER_REQUEST
    assert args.max_queued_requests == limits.DEFAULT_MAX_QUEUED_REQUESTS
    assert args.max_request_body_bytes == limits.DEFAULT_MAX_REQUEST_BODY_BYTES
    assert args.grammar_compile_timeout_s == limits.DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S
    assert args.shutdown_timeout_s == limits.DEFAULT_SHUTDOWN_TIMEOUT_S
    assert SamplingParams().max_tokens == limits.DEFAULT_MAX_TOKENS
