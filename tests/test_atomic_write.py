"""write_text_atomically: the new text or the old one, never a partial file or a leftover."""

import pytest

from dllm_jax.common.atomic_write import write_text_atomically

pytestmark = pytest.mark.unit


def test_writes_and_replaces_without_leftovers(tmp_path):
    path = tmp_path / "reports" / "bench.json"
    write_text_atomically(path, "first")
    write_text_atomically(path, "second")
    assert path.read_text() == "second"
    assert [p.name for p in path.parent.iterdir()] == ["bench.json"]


def test_a_failed_write_keeps_the_old_file(tmp_path):
    path = tmp_path / "eval.md"
    path.write_text("old")
    with pytest.raises(UnicodeEncodeError):
        write_text_atomically(path, "half \udcff")  # a lone surrogate cannot be encoded
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["eval.md"]
