"""Reads and writes protobuf messages as binary (.pb), text (.pbtxt) or JSON (.json), by extension.

JSON uses the proto field names (snake_case). Every failure raises SchemaError naming the file
(and the line, where the parser reports one).
"""

import os

from google.protobuf import json_format, message, text_format

FORMATS = (".pb", ".pbtxt", ".json")


class SchemaError(ValueError):
    """A schema file that cannot be read or written; the message names the file."""


def _format_of(path):
    ext = os.path.splitext(path)[1].lower()
    if ext not in FORMATS:
        raise SchemaError(f"{path}: unknown extension {ext!r}; expected one of {', '.join(FORMATS)}")
    return ext


def write_message(msg, path):
    """Writes `msg` to `path` in the format its extension names."""
    ext = _format_of(path)
    if ext == ".pb":
        data = msg.SerializeToString()
    elif ext == ".pbtxt":
        data = text_format.MessageToString(msg).encode()
    else:
        data = (json_format.MessageToJson(msg, preserving_proto_field_name=True, indent=2) + "\n").encode()
    try:
        with open(path, "wb") as f:
            f.write(data)
    except OSError as e:
        raise SchemaError(f"{path}: cannot write: {e.strerror}") from e


def read_message(path, message_class):
    """Reads a `message_class` message from `path` in the format its extension names."""
    ext = _format_of(path)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise SchemaError(f"{path}: cannot read: {e.strerror}") from e
    msg = message_class()
    kind = message_class.DESCRIPTOR.full_name
    try:
        if ext == ".pb":
            msg.ParseFromString(data)
        elif ext == ".pbtxt":
            text_format.Parse(data.decode("utf-8"), msg)
        else:
            json_format.Parse(data.decode("utf-8"), msg)
    except text_format.ParseError as e:
        raise SchemaError(f"{path}:{e.GetLine()}: not a valid {kind} text proto: {e}") from e
    except json_format.ParseError as e:
        raise SchemaError(f"{path}: not a valid {kind} JSON file: {e}") from e
    except (message.DecodeError, UnicodeDecodeError) as e:
        raise SchemaError(f"{path}: not a valid {kind} file: {e}") from e
    return msg
