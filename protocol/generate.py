"""Regenerate the checked-in gRPC stubs from fedpar.proto: ``python -m fedpar.protocol.generate``."""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROTO = "fedpar.proto"
OUTPUTS = ("fedpar_pb2.py", "fedpar_pb2.pyi", "fedpar_pb2_grpc.py")


def generate(out_dir: Path) -> list[Path]:
    """Run grpcio-tools' protoc on fedpar.proto, writing the stubs into ``out_dir``."""
    try:
        from grpc_tools import protoc
    except ImportError:  # pragma: no cover - dev dependency
        raise SystemExit("grpcio-tools is missing: pip install -e '.[dev]'") from None
    rc = protoc.main(["protoc", f"-I{HERE}", f"--python_out={out_dir}", f"--pyi_out={out_dir}",
                      f"--grpc_python_out={out_dir}", str(HERE / PROTO)])
    if rc != 0:
        raise SystemExit(f"protoc failed with exit code {rc}")
    grpc_file = out_dir / "fedpar_pb2_grpc.py"
    # protoc writes an absolute `import fedpar_pb2`; make it package-relative.
    text = re.sub(r"^import fedpar_pb2 as", "from . import fedpar_pb2 as", grpc_file.read_text(), flags=re.M)
    grpc_file.write_text(text)
    return [out_dir / name for name in OUTPUTS]


def main() -> int:
    """Regenerate the stubs in place, or with ``--check`` report whether they are current."""
    if "--check" in sys.argv:
        with tempfile.TemporaryDirectory() as tmp:
            stale = [p.name for p in generate(Path(tmp)) if p.read_bytes() != (HERE / p.name).read_bytes()]
        if stale:
            print(f"stale generated stubs: {stale}; run: python -m fedpar.protocol.generate")
            return 1
        print("stubs are current")
        return 0
    for path in generate(HERE):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
