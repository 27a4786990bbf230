"""Reading the project's small JSON files (config.json, tokenizer.json, tokenizer_config.json) with errors that name
the file and the problem: missing, empty, not text, truncated or invalid JSON, not a JSON object."""

from __future__ import annotations

import json
import os


def read_json_object(path: str | os.PathLike, what: str, error: type[Exception] = ValueError) -> dict:
    """The JSON object in ``path``; ``what`` says what the file should hold (for the message); ``error`` is the
    exception class raised for a file that exists but is not a JSON object (a missing file: FileNotFoundError)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        raise error(f"{path}: is a directory, expected {what}")
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: file not found (expected {what})") from None
    if not raw.strip():
        raise error(f"{path}: the file is empty (expected {what})")
    try:
        value = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise error(f"{path}: not a text file (invalid UTF-8 at byte {e.start}; expected {what})") from None
    except json.JSONDecodeError as e:
        ends_early = e.pos >= len(raw.rstrip()) - 1 or e.msg.startswith("Unterminated")
        truncated = "; the file looks truncated" if ends_early else ""
        raise error(f"{path}: invalid JSON ({e.msg}, line {e.lineno} column {e.colno}){truncated}; expected "
                    f"{what}") from None
    if not isinstance(value, dict):
        raise error(f"{path}: expected {what}, got a JSON {type(value).__name__}")
    return value


__all__ = ["read_json_object"]
