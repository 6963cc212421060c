import pytest

from edgeflow.tracking.artifacts import ChecksumError, sha256_tree, verify_manifest, write_manifest


def _tree(root):
    (root / "engine").mkdir(parents=True)
    (root / "engine" / "model.onnx").write_bytes(b"\x00weights" * 100)
    (root / "gate.json").write_text("{}")
    return write_manifest(root)


def test_manifest_round_trip_and_tree_hash(tmp_path):
    tree = _tree(tmp_path)
    verify_manifest(tmp_path, tree)
    assert sha256_tree(tmp_path) == tree  # the manifest itself is not part of the hash


def test_corrupted_file_is_named(tmp_path):
    tree = _tree(tmp_path)
    (tmp_path / "engine" / "model.onnx").write_bytes(b"\x00weightz" * 100)
    with pytest.raises(ChecksumError, match=r"engine/model.onnx: sha256 .* does not match"):
        verify_manifest(tmp_path, tree)


def test_missing_file_and_swapped_manifest_are_refused(tmp_path):
    tree = _tree(tmp_path)
    (tmp_path / "gate.json").unlink()
    with pytest.raises(ChecksumError, match="files missing"):
        verify_manifest(tmp_path, tree)
    (tmp_path / "gate.json").write_text("{}")
    with pytest.raises(ChecksumError, match="differs from the registered"):
        verify_manifest(tmp_path, "0" * 64)
    (tmp_path / "edgeflow-manifest.json").unlink()
    with pytest.raises(ChecksumError, match="no edgeflow-manifest.json"):
        verify_manifest(tmp_path)
