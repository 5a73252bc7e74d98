"""The committed Python stubs are exactly what the generator produces from the current `.proto` files, so an edited
contract with stale stubs fails here instead of at run time."""

from __future__ import annotations

from proto.generate import ROOT, generate


def test_committed_stubs_match_a_fresh_generation(tmp_path):
    fresh = {p.name: p.read_bytes() for p in generate(tmp_path)}
    committed = {p.name: p.read_bytes() for p in (ROOT / "proto").glob("*_pb2*.py")}
    assert fresh, "the generator produced no stubs"
    missing = sorted(set(fresh) - set(committed))
    orphaned = sorted(set(committed) - set(fresh))
    stale = sorted(name for name in set(fresh) & set(committed) if fresh[name] != committed[name])
    fix = "run `python -m proto.generate` from the repository root and commit the result"
    assert not missing, f"stubs not committed: {missing}; {fix}"
    assert not orphaned, f"stubs without a .proto: {orphaned}; delete them"
    assert not stale, f"stale stubs: {stale}; {fix}"


def test_every_proto_has_its_message_stub(tmp_path):
    protos = sorted(p.stem for p in (ROOT / "proto").glob("*.proto"))
    assert protos, "no .proto files found"
    assert all((ROOT / "proto" / f"{name}_pb2.py").is_file() for name in protos), protos
