"""Regenerate the Python stubs for every `proto/*.proto` (run from the repository root: `python -m proto.generate`)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def generate(out_dir: Path = ROOT) -> list[Path]:
    """Compile every contract into `out_dir/proto/`; returns the generated files."""
    from grpc_tools import protoc
    import grpc_tools

    protos = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "proto").glob("*.proto"))
    include = str(Path(grpc_tools.__file__).parent / "_proto")
    args = ["protoc", f"-I{ROOT}", f"-I{include}", f"--python_out={out_dir}", f"--grpc_python_out={out_dir}", *protos]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    return sorted((out_dir / "proto").glob("*_pb2*.py"))


if __name__ == "__main__":
    for path in generate():
        print(path.relative_to(ROOT), file=sys.stderr)
