"""Reading and writing layer cost profiles: protobuf (.pb/.pbtxt/.json) or PipeDream text (.txt).

PipeDream text is read and written by planner/formats/profile.py (the planner reads profiles without
importing the profiler); this module only routes by extension and checks that a .txt path naming a
batch size (`...-pbs-N.txt`, PipeDream's convention) names the profile's (the text itself holds the
model name and batch size in `#` header lines). Errors are ValueErrors (planner.formats.profile.ProfileError, planner.formats.SchemaError)
naming the file.
"""

import os

from planner.formats import profile as pipedream
from planner.formats import layer_cost_pb2, write_message

PROTO_FORMATS = (".pb", ".pbtxt", ".json")
TEXT_FORMAT = ".txt"


def _extension(path):
    ext = os.path.splitext(path)[1].lower()
    if ext not in PROTO_FORMATS + (TEXT_FORMAT,):
        raise ValueError(f"{path}: unknown profile extension {ext!r}; expected .pb, .pbtxt, .json or .txt")
    return ext


def read_profile(path, batch_size=None) -> layer_cost_pb2.LayerCostProfile:
    """Reads a profile in any supported format (a .txt's batch size comes from `-pbs-N` or `batch_size`)."""
    _extension(path)
    return pipedream.load_profile(path, batch_size=batch_size)


def check_writable(path, batch_size):
    """Raises ValueError unless a profile of `batch_size` can be written to `path` (before profiling)."""
    ext = _extension(path)
    directory = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ValueError(f"{path}: cannot write: it is a directory")
    if not os.path.isdir(directory):
        raise ValueError(f"{path}: cannot write: directory {directory} does not exist")
    if not os.access(directory, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise ValueError(f"{path}: cannot write: permission denied")
    if ext == TEXT_FORMAT:
        in_name = pipedream.batch_size_from_name(path)
        if in_name is not None and in_name != batch_size:
            raise ValueError(
                f"{path}: the file name says batch size {in_name} but the profile's is {batch_size}; name it "
                f"`...-pbs-{batch_size}.txt` (or leave -pbs- out)")
    return ext


def write_profile(profile, path):
    """Writes `profile` in the format `path`'s extension names (check_writable's checks first)."""
    if check_writable(path, profile.batch_size) == TEXT_FORMAT:
        pipedream.write_pipedream(profile, path)
    else:
        write_message(profile, path)


def format_pipedream(profile) -> str:
    """The PipeDream text of a profile (planner.formats.profile.format_pipedream)."""
    return pipedream.format_pipedream(profile)
